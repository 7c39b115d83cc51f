"""docker-compose.yml and the Dockerfile stay in step with the code. Docker does
not run here, so ``docker compose config`` cannot; these checks read both files instead:
every topic is created up front, every servewatch command parses, dependencies are
installed when the image is built (never when a container starts), and nothing listens
beyond the host's loopback."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import yaml

from servewatch.pipeline import topics
from servewatch.pipeline.cli.main import build_parser
from servewatch.pipeline.settings import GROUPS, NAMES, Settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
OURS = {name: service for name, service in SERVICES.items() if service.get("image") == "servewatch:local"}


def _interpolated(text: str) -> str:
    """Compose's ``${VAR:-default}`` as its default, ``$$`` as ``$``."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text).replace("$$", "$")


def test_compose_creates_every_topic() -> None:
    script = "\n".join(SERVICES["topics"]["command"])
    assert set(re.findall(r"^\s*create (servewatch\.[a-z]+)", script, re.M)) == set(topics.ALL)


def test_compose_creates_each_topic_with_the_settings_ensure_topics_uses() -> None:
    """The compose file's topics and ``ensure_topics``'s (on Apache Kafka and the embedded
    broker) carry the same configs; ``tests/test_apache_kafka.py`` reads them back from Kafka."""
    script = "\n".join(SERVICES["topics"]["command"])
    compose = {
        name: dict(re.findall(r"--config ([a-z.]+)=(\S+)", rest))
        for name, rest in re.findall(r"^\s*create (servewatch\.[a-z]+)(.*)$", script, re.M)
    }
    assert compose == {name: topics.TOPIC_CONFIGS.get(name, {}) for name in topics.ALL}
    assert Settings().kafka.max_message_bytes == topics.REQUESTS_MAX_MESSAGE_BYTES


def test_every_servewatch_service_runs_the_built_image_with_a_command_that_parses() -> None:
    assert {"worker-a", "worker-b", "scraper", "shipper", "shipper-http"} <= set(OURS)
    for name, service in OURS.items():
        assert service["build"] == ".", name
        command = [_interpolated(part) for part in service["command"]]
        assert "pip" not in " ".join(command), f"{name} installs at start"
        build_parser().parse_args(command)
        for dependency in service.get("depends_on", {}):
            assert dependency in SERVICES, f"{name} depends on a missing service {dependency}"
    workers = [s for s in OURS.values() if s["command"] == ["worker"]]
    assert len(workers) == 2 and all("healthcheck" in s for s in workers)
    assert not any("SERVEWATCH_APP_ID" in s.get("environment", {}) for s in workers), "one consumer group"


def test_nothing_listens_beyond_the_loopback() -> None:
    for name, service in SERVICES.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port}"


def test_the_image_holds_every_packaged_folder_and_runs_servewatch() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    copied = set(re.findall(r"^COPY (\S+)/ ", dockerfile, re.M))
    assert set(mapping.values()) <= copied
    assert re.search(r'^ENTRYPOINT \["servewatch"\]', dockerfile, re.M)
    assert re.search(r"^RUN pip install ", dockerfile, re.M) and re.search(r"^USER ", dockerfile, re.M)


def test_the_shell_commands_of_the_topics_service_quote_compose_variables() -> None:
    """``$$`` in compose is a literal ``$`` for the shell; a lone ``$`` would be compose's."""
    script = "\n".join(SERVICES["topics"]["command"])
    assert "$$@" in script and not re.search(r"(?<!\$)\$(?![${])", script)
    shlex.split(_interpolated(script.splitlines()[-1]))


def test_the_notifier_gets_its_secrets_a_healthcheck_and_a_metrics_port() -> None:
    notifier = OURS["notifier"]
    assert [entry["path"] for entry in notifier["env_file"]] == ["${SERVEWATCH_NOTIFY_DIR:-./deploy}/notify.env"]
    assert notifier["env_file"][0]["required"] is False  # optional: a config without secrets runs too
    port = notifier["environment"]["SERVEWATCH_METRICS_PORT"]
    assert any(str(p).endswith(f":{port}") for p in notifier["ports"])
    assert f":{port}/metrics" in " ".join(notifier["healthcheck"]["test"])


def test_the_triage_page_the_notifications_link_to_is_served() -> None:
    web = OURS["web"]
    assert web["command"][0] == "web" and web["profiles"] == OURS["notifier"]["profiles"]
    assert web["env_file"] == OURS["notifier"]["env_file"]  # its SERVEWATCH_WEB_TOKEN
    example = yaml.safe_load((ROOT / "deploy" / "notify.example.yaml").read_text())
    published = {str(p).split(":")[1] for p in web["ports"]}
    assert example["triage_url"].startswith(f"http://127.0.0.1:{published.pop()}/")


def test_every_published_metrics_port_listens_beyond_the_containers_loopback() -> None:
    """Metrics listen on the loopback by default; a container whose port is published must
    listen on its own interfaces, or the host sees nothing."""
    for name, service in OURS.items():
        env = service.get("environment", {})
        if "SERVEWATCH_METRICS_PORT" in env and service.get("ports"):
            assert env.get("SERVEWATCH_METRICS_HOST") == "0.0.0.0", name


def test_every_setting_is_documented_in_the_readme_with_a_description_in_its_class() -> None:
    # An operator reads the README's Configuration section, not settings.py: a setting it
    # does not name is one nobody finds (and `check-config` reports an unknown name as a typo).
    readme = (ROOT / "README.md").read_text()
    fields = {name: GROUPS[attr].model_fields[field] for name, (attr, field) in NAMES.items()}
    names = {f"SERVEWATCH_{name.upper()}": field for name, field in fields.items()}
    undocumented = sorted(env for env in names if env not in readme)
    assert not undocumented, f"settings not in README.md: {undocumented}"
    undescribed = sorted(env for env, field in names.items() if not field.description)
    assert not undescribed, f"settings without a description in pipeline/settings.py: {undescribed}"
