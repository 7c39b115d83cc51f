// servewatch triage page: live rows (server-sent events) and verdicts.
// Every value from a record is set with textContent or setAttribute, never parsed as
// HTML: request content must stay text. No framework, nothing fetched from elsewhere.
"use strict";

(function () {
  const body = document.body;
  const meta = document.querySelector('meta[name="csrf-token"]');
  const csrf = meta ? meta.getAttribute("content") : "";
  const live = document.getElementById("live");
  const SEVERITY = { info: 0, warning: 1, critical: 2 };

  function el(tag, attributes, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attributes || {})) node.setAttribute(name, String(value));
    for (const child of children) node.append(child); // strings become text nodes
    return node;
  }

  function utc(seconds) {
    return new Date(seconds * 1000).toISOString().slice(0, 19).replace("T", " ") + "Z";
  }

  function segmentLabel(segment) {
    const parts = Object.entries(segment || {}).filter(([k, v]) => k !== "model" && v !== "-").map(([, v]) => v);
    return parts.length ? parts.join(" / ") : "all";
  }

  function badge(kind, value) {
    return el("span", { class: "badge " + kind + "-" + value }, value);
  }

  function verdictText(verdict) {
    return String(verdict || "").replace("_", " ");
  }

  // -- the group list ------------------------------------------------------------------------
  const filterForm = document.getElementById("filters");
  if (filterForm) {
    for (const select of filterForm.querySelectorAll("select")) {
      select.addEventListener("change", () => filterForm.submit());
    }
  }

  function kept(group) {
    if (!filterForm) return true;
    const f = Object.fromEntries(new FormData(filterForm).entries());
    if (f.model && group.model !== f.model) return false;
    if (f.signal && !group.signals.includes(f.signal)) return false;
    if (f.severity && SEVERITY[group.severity] < SEVERITY[f.severity]) return false;
    if (f.status && group.status !== f.status) return false;
    return true;
  }

  function groupRow(group, verdict) {
    const row = el("tr", {
      class: "group fresh sev-" + group.severity + " st-" + group.status,
      "data-key": group.group, "data-model": group.model, "data-signals": group.signals.join(" "),
      "data-severity": group.severity, "data-status": group.status, "data-start": group.window_start,
    });
    const members = el("div", { class: "members" });
    for (const m of group.members) {
      members.append(el("span", { class: "member st-" + m.status }, m.signal + " " + segmentLabel(m.segment)));
    }
    const title = el("a", { class: "title", href: "/groups/" + encodeURIComponent(group.group) }, group.title);
    row.append(
      el("td", {}, utc(group.window_start)), el("td", {}, badge("st", group.status)),
      el("td", {}, badge("sev", group.severity)), el("td", {}, title, members), el("td", {}, group.model),
      el("td", {}, group.cause), el("td", {}, group.signals.join(", ")), el("td", {}, String(group.segments)),
      el("td", { class: "verdict" }, verdict),
    );
    return row;
  }

  function rowOf(tbody, key) {
    return Array.from(tbody.rows).find((row) => row.dataset.key === key) || null;
  }

  function showGroup(group) {
    const tbody = document.querySelector("#groups tbody");
    if (!tbody) return;
    const existing = rowOf(tbody, group.group);
    const latest = group.feedback ? verdictText(group.feedback.verdict) : "";
    const verdict = existing ? existing.querySelector(".verdict").textContent || latest : latest;
    if (existing) existing.remove();
    if (kept(group)) {
      const row = groupRow(group, verdict);
      const later = Array.from(tbody.rows).find((r) => Number(r.dataset.start) < group.window_start);
      tbody.insertBefore(row, later || null);
    }
    document.getElementById("no-groups").hidden = tbody.rows.length > 0;
  }

  function showVerdictInList(feedback) {
    const tbody = document.querySelector("#groups tbody");
    const row = tbody && rowOf(tbody, feedback.group);
    if (row) row.querySelector(".verdict").textContent = verdictText(feedback.verdict);
  }

  // -- a group's page ----------------------------------------------------------------------------
  const feedbackForm = document.getElementById("feedback-form");
  const feedbackList = document.getElementById("feedback-list");
  const feedbackStatus = document.getElementById("feedback-status");

  function feedbackItem(f) {
    const item = el("li", { "data-id": f.by + "|" + f.at + "|" + f.verdict }, el("strong", {}, verdictText(f.verdict)),
      " by " + f.by + " at " + utc(f.at) + (f.comment ? ": " + f.comment : ""));
    return item;
  }

  function addFeedback(f) {
    if (!feedbackList) return;
    const id = f.by + "|" + f.at + "|" + f.verdict;
    if (Array.from(feedbackList.children).some((li) => li.dataset.id === id)) return;
    feedbackList.append(feedbackItem(f));
  }

  async function giveVerdict(verdict) {
    const byInput = document.getElementById("feedback-by");
    const by = byInput.value.trim();
    if (!by) {
      feedbackStatus.textContent = "Enter your name first: verdicts say who gave them.";
      byInput.focus();
      return;
    }
    localStorage.setItem("servewatch-name", by);
    const comment = document.getElementById("feedback-comment").value;
    feedbackStatus.textContent = "sending ...";
    try {
      const response = await fetch("/api/groups/" + encodeURIComponent(feedbackForm.dataset.key) + "/feedback", {
        method: "POST", credentials: "same-origin",
        headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf },
        body: JSON.stringify({ verdict, by, comment }),
      });
      const answer = await response.json();
      if (!response.ok) {
        feedbackStatus.textContent = "Not recorded: " + (answer.error || response.status);
        return;
      }
      for (const f of answer.all) addFeedback(f);
      feedbackStatus.textContent = "Recorded: " + verdictText(verdict) + " by " + by + ".";
    } catch (error) {
      feedbackStatus.textContent = "Not recorded: " + error;
    }
  }

  if (feedbackForm) {
    const byInput = document.getElementById("feedback-by");
    if (!byInput.value) byInput.value = localStorage.getItem("servewatch-name") || "";
    feedbackForm.addEventListener("submit", (event) => event.preventDefault());
    feedbackForm.addEventListener("click", (event) => {
      const button = event.target.closest("button[data-verdict]");
      if (button) giveVerdict(button.dataset.verdict);
    });
  }

  function updateGroupState(group) {
    const state = document.getElementById("group-state");
    const badges = state ? state.querySelectorAll(".badge") : [];
    if (badges.length >= 2) {
      badges[0].replaceWith(badge("st", group.status));
      badges[1].replaceWith(badge("sev", group.severity));
    }
  }

  function updateMember(event) {
    const table = document.querySelector("#members tbody");
    if (!table) return;
    const row = Array.from(table.rows).find((r) => r.dataset.fingerprint === event.fingerprint);
    if (row) {
      row.querySelector(".status").replaceChildren(badge("st", event.status));
      return;
    }
    const link = el("a", { href: "/anomalies/" + encodeURIComponent(event.id) }, event.signal);
    table.prepend(el("tr", { "data-fingerprint": event.fingerprint, class: "fresh" },
      el("td", {}, link), el("td", {}, segmentLabel(event.segment)), el("td", { class: "status" },
        badge("st", event.status)), el("td", {}, badge("sev", event.severity)),
      el("td", { class: "num" }, event.score.toPrecision(3)), el("td", { class: "num" }, ""),
      el("td", {}, utc(event.window_start))));
  }

  // -- live updates --------------------------------------------------------------------------------
  const page = body.dataset.page;

  // One server-sent event stream: the live badge follows its state, each record goes to onRecord.
  function follow(url, onRecord) {
    const stream = new EventSource(url);
    stream.onopen = () => {
      live.textContent = "live";
      body.dataset.live = "open";
    };
    stream.onerror = () => {
      live.textContent = "reconnecting";
      body.dataset.live = "closed";
    };
    stream.onmessage = (message) => {
      let record;
      try {
        record = JSON.parse(message.data);
      } catch (error) {
        return;
      }
      onRecord(record);
    };
  }

  if ((page === "changes" || page === "change") && window.EventSource) {
    // a new marker or report: say so (the tables are the server's; a reload shows them)
    const notice = document.getElementById("changes-updated");
    follow("/api/stream?kinds=change_marker,change_report", (record) => {
      const id = record.kind === "change_report" ? record.change : record.id;
      if (page === "change" && id !== body.dataset.change) return;
      if (notice) notice.hidden = false;
    });
  }
  if ((page === "groups" || page === "group") && window.EventSource) {
    follow("/api/stream", (record) => {
      if (page === "groups") {
        if (record.kind === "group") showGroup(record);
        if (record.kind === "feedback") showVerdictInList(record);
        return;
      }
      if (record.kind === "group" && record.group === body.dataset.group) updateGroupState(record);
      if (record.kind === "feedback" && record.group === body.dataset.group) addFeedback(record);
      if (record.kind === "incident" && record.group === body.dataset.group) updateMember(record);
    });
  }
})();
