"""How surprising is a residual, when noise has heavy tails and faults last?

Pure functions behind the latency models' scores (``models.stats.latency``):

* ``student_surprise``: ``-log10`` of a Student-t tail, scaled to unit variance, so the
  same standardised residual is less surprising for a segment with heavier tails;
* ``degrees_of_freedom`` and ``tail_bound``: the tails a segment has shown, as the share
  of its residuals beyond 3 sds (0.27 % for Gaussian noise), read cautiously while the
  count of such rare windows is small;
* ``tail_step``: that share, learned from short clusters beyond 3 sds only (heavy-tailed
  noise throws single wild windows; a fault shifts a run of them, or flickers, and must
  not teach the model that its tails are heavy);
* ``pair_surprise``: two windows in a row both high. A fault lasts; noise, however heavy
  its tails, rarely throws two wild windows in a row (their correlation ``rho`` is
  learned). So a 2x slowdown that is 3.5 sds per window, unremarkable alone under heavy
  tails, is very surprising twice.

Scores are ``-log10`` of a tail probability: 4 means 1 in 10,000, on every signal.
"""

from __future__ import annotations

import functools
import math

from scipy.special import ndtri, stdtr, stdtrit

_LN10 = math.log(10.0)
#: Residuals beyond this many sds count as tail events.
TAIL_Z = 3.0
#: Runs of windows beyond ``TAIL_Z`` at most this long count as tails; longer ones as a change.
TAIL_RUN = 2
#: Innovation (sds beyond the echo of the window before) that keeps a run going.
RUN_PUSH = 1.0
#: Quiet windows after which a cluster of tail windows is over (a minute of 10 s windows):
#: a fault that flickers comes back sooner; noise's rare wild windows seldom do.
TAIL_QUIET = 6
#: Weight of each tail event's echo in ``echo`` (about the last five), and "none seen yet".
ECHO_RATE = 0.2
NO_ECHO = -1.0
#: Degrees of freedom a segment's tails start from; what that prior is worth, in windows;
#: and how many windows the tail share remembers (about three hours of 10 s windows).
PRIOR_NU = 12.0
TAIL_PRIOR_WINDOWS = 100.0
TAIL_MEMORY = 1000.0
#: Standard errors added to the estimated share before it sets the tails (``tail_bound``).
TAIL_CAUTION = 1.5


def upper_tail_surprise(z: float) -> float:
    """``-log10 P(Z >= z)`` for a standard normal, accurate far into the tail.

    >>> round(upper_tail_surprise(0.0), 3), round(upper_tail_surprise(3.0), 2)
    (0.301, 2.87)
    >>> upper_tail_surprise(60.0) > upper_tail_surprise(50.0) > 500
    True
    """
    if z < 8.0:
        return -math.log10(max(0.5 * math.erfc(z / math.sqrt(2.0)), 1e-300))
    # Mills-ratio asymptote: log sf(z) ~ -z^2/2 - log(z) - log(sqrt(2 pi)).
    log_sf = -0.5 * z * z - math.log(z) - 0.5 * math.log(2.0 * math.pi)
    return -log_sf / _LN10


def student_surprise(z: float, nu: float) -> float:
    """``-log10 P(T >= z)`` for a Student-t of ``nu`` degrees scaled to unit variance.

    Heavy tails cost sensitivity where they are real: 1 in 10,000 is 3.7 sds for Gaussian
    noise, about 9.2 for ``nu=4``.

    >>> round(student_surprise(3.72, 1000.0), 1), round(student_surprise(9.2, 4.0), 1)
    (4.0, 4.0)
    """
    if nu >= 200.0:
        return upper_tail_surprise(z)
    scaled = z * math.sqrt(nu / (nu - 2.0))
    return -math.log10(max(float(stdtr(nu, -scaled)), 1e-300))


#: A window judged by two looks (alone, and with another: the window before, or the run so
#: far) scores the larger less log10(2), so that looking twice costs no calibration.
TWO_LOOKS = math.log10(2.0)


def student_bound(surprise: float, nu: float) -> float:
    """The residual ``z`` at which ``student_surprise(z, nu)`` reaches ``surprise``: its inverse,
    for drawing the band a window must leave to be that surprising.

    >>> round(student_bound(4.0, 1000.0), 2), round(student_bound(student_surprise(5.0, 4.0), 4.0), 2)
    (3.72, 5.0)
    """
    tail = 10.0 ** (-surprise)
    if nu >= 200.0:
        return float(ndtri(1.0 - tail))
    return float(-stdtrit(nu, tail)) / math.sqrt(nu / (nu - 2.0))


def _tail_share_of(nu: float) -> float:
    """P(|T| > TAIL_Z) for a unit-variance Student-t of ``nu`` degrees."""
    return 2.0 * float(stdtr(nu, -TAIL_Z * math.sqrt(nu / (nu - 2.0))))


#: Share of residuals beyond ``TAIL_Z`` a segment starts from (``PRIOR_NU``'s).
PRIOR_TAIL_SHARE = _tail_share_of(PRIOR_NU)

#: Degrees of freedom from 3 (the heaviest judged) to near-Gaussian, and the share of
#: unit-variance residuals beyond 3 each implies (falling with nu over this range).
_NU_GRID = (3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 20.0, 40.0, 100.0, 1000.0)
_SHARE_GRID = tuple(_tail_share_of(nu) for nu in _NU_GRID)


@functools.lru_cache(maxsize=1024)
def degrees_of_freedom(tail_share: float) -> float:
    """The Student-t degrees of freedom whose share of residuals beyond 3 sds is ``tail_share``.

    >>> degrees_of_freedom(0.0027) > 500, round(degrees_of_freedom(0.0065)), degrees_of_freedom(0.05)
    (True, 12, 3.0)
    """
    if tail_share >= _SHARE_GRID[0]:
        return _NU_GRID[0]
    if tail_share <= _SHARE_GRID[-1]:
        return _NU_GRID[-1]
    for i in range(len(_NU_GRID) - 1):  # the shares fall with nu: interpolate in log share
        high, low = _SHARE_GRID[i], _SHARE_GRID[i + 1]
        if low <= tail_share <= high:
            w = math.log(high / tail_share) / math.log(high / low)
            return _NU_GRID[i] + w * (_NU_GRID[i + 1] - _NU_GRID[i])
    return _NU_GRID[-1]


@functools.lru_cache(maxsize=4096)
def clipped_square_mean(c: float, nu: float) -> float:
    """E[min(T^2, c^2)] for a unit-variance Student-t of ``nu`` degrees (a Gaussian above 200):
    what clipping residuals at ``c`` sds leaves of their mean square. Dividing a clipped
    mean square by it estimates the variance again, consistently for tails that heavy.

    >>> round(clipped_square_mean(2.0, 1000.0), 2), round(clipped_square_mean(3.0, 3.0), 2)
    (0.92, 0.73)
    """
    if nu >= 200.0:
        density = math.exp(-0.5 * c * c) / math.sqrt(2.0 * math.pi)
        beyond = math.erfc(c / math.sqrt(2.0))
        return (1.0 - beyond) - 2.0 * c * density + c * c * beyond
    # Midpoint rule over |T| < c on the unit-variance scale (t = z * sqrt(nu / (nu - 2))).
    scale = math.sqrt(nu / (nu - 2.0))
    steps = 400
    log_norm = math.lgamma((nu + 1.0) / 2.0) - math.lgamma(nu / 2.0) - 0.5 * math.log(nu * math.pi)
    inside = 0.0
    for i in range(steps):
        z = (i + 0.5) * c / steps
        t = z * scale
        density = math.exp(log_norm - 0.5 * (nu + 1.0) * math.log1p(t * t / nu)) * scale
        inside += 2.0 * z * z * density * c / steps
    beyond = 2.0 * float(stdtr(nu, -c * scale))
    return inside + c * c * beyond


def tail_bound(share: float, windows: int) -> float:
    """The tail share plus ``TAIL_CAUTION`` standard errors of its estimate, a count of rare
    events over the ``windows`` seen (with the prior's, at most ``TAIL_MEMORY``).

    The share beyond 3 sds fixes the shoulder of the distribution; real residuals are
    mixtures (a heavy-tailed part plus Gaussian sampling noise) whose far tail is heavier
    than a Student-t fitted to the shoulder, so the model errs towards heavy tails while
    its evidence is thin.

    >>> tail_bound(0.0065, 0) == 0.0065, round(tail_bound(0.0027, 5000), 4)
    (True, 0.005)
    """
    seen = min(float(windows), TAIL_MEMORY - TAIL_PRIOR_WINDOWS)
    return share + TAIL_CAUTION * math.sqrt(share * seen) / (TAIL_PRIOR_WINDOWS + seen)


def _run_parts(run: float) -> tuple[float, int, int]:
    """``run`` packed as one number (a segment's state is a flat run of doubles): its sign
    is the direction, its whole part the windows beyond ``TAIL_Z`` (or pushing) in the
    current cluster, its fraction the quiet windows since, in ``TAIL_QUIET``-ths."""
    if not run:
        return 0.0, 0, 0
    size = abs(run)
    windows = int(size)
    return (1.0 if run > 0 else -1.0), windows, round((size - windows) * TAIL_QUIET)


def _run_of(direction: float, windows: int, quiet: int) -> float:
    return direction * (windows + quiet / TAIL_QUIET) if windows else 0.0


def tail_step(
    share: float,
    run: float,
    z: float,
    last_z: float,
    rho: float,
    windows: int,
    echo: float = NO_ECHO,
    pending: float = NO_ECHO,
) -> tuple[float, float, float, float]:
    """The tail share, the current cluster, the echo of wild windows and the echo seen in
    the current cluster, after one more window of standardised residual ``z`` (sds), the
    ``windows``-th seen; ``last_z`` and ``rho``: the window before and the lag-one
    correlation. ``run`` is signed and packed (``_run_parts``).

    A cluster starts with a window beyond ``TAIL_Z`` and goes on while each window pushes
    the same way by more than its predecessor's echo explains (``RUN_PUSH`` sds of
    innovation), or comes back the same way within ``TAIL_QUIET`` windows (by ``TAIL_Z`` sds
    of innovation: more than an echo). It counts once that many quiet windows have passed,
    and only if it was short (``TAIL_RUN`` windows at most): a wild window and its fading
    echo are the noise's tails; a fault keeps pushing, or flickers back, and must not teach
    the model that its tails are heavy (a fault's first, lone anomalous window would
    otherwise blind the model to the rest of it).

    The window after a cluster's first shows how much of a wild window the next one echoes
    (``z / last_z``); once the cluster counts as noise, that ratio goes into ``echo``
    (``ECHO_RATE``), which the pair statistic uses after a wild window. Heavy-tailed,
    autocorrelated noise echoes its wild windows more than the correlation of ordinary ones
    (which clipping and the noise of sampling dilute) says, and a pair of a wild window and
    its echo is no fault.

    >>> share, run, echo, pending = PRIOR_TAIL_SHARE, 0.0, NO_ECHO, NO_ECHO
    >>> zs = (0.5, 6.0, 3.0, 0.3, 0.1, -0.4, 0.2, 0.5, 0.0)  # a wild window, its echo, calm
    >>> for last_z, z in zip((0.0, *zs), zs):
    ...     share, run, echo, pending = tail_step(share, run, z, last_z, 0.4, 400, echo, pending)
    >>> round(share, 4), run, round(echo, 2)
    (0.0084, 0.0, 0.5)
    >>> share, run, echo, pending = PRIOR_TAIL_SHARE, 0.0, NO_ECHO, NO_ECHO
    >>> zs = (4.5, 0.8, 1.2, 3.6, 1.0, 3.4, 0.5, 0.2, 0.1, 0.0, 0.3, 0.1)  # a fault that flickers
    >>> for last_z, z in zip((0.0, *zs), zs):
    ...     share, run, echo, pending = tail_step(share, run, z, last_z, 0.4, 400, echo, pending)
    >>> share < PRIOR_TAIL_SHARE, run, echo == NO_ECHO
    (True, 0.0, True)
    """
    rate = max(1.0 / TAIL_MEMORY, 1.0 / (windows + TAIL_PRIOR_WINDOWS))
    share -= share * rate  # this window, as an ordinary one for now
    direction, count, quiet = _run_parts(run)
    if count:
        if count == 1 and quiet == 0 and pending == NO_ECHO:  # the window right after the first
            pending = min(max(z / last_z, 0.0), 1.0) if last_z else NO_ECHO
        rho = min(max(rho, 0.0), 0.9)
        push = direction * (z - rho * last_z) / math.sqrt(1.0 - rho * rho)
        if push > (RUN_PUSH if quiet == 0 else TAIL_Z):
            return share, _run_of(direction, count + 1, 0), echo, pending  # the cluster goes on, or is back
        if count > TAIL_RUN:
            count, pending = 0, NO_ECHO  # a change, now over: not the noise's tails
        elif -direction * z > TAIL_Z or quiet + 1 >= TAIL_QUIET:
            share += count * rate  # a short cluster, now over: the tails after all
            if pending != NO_ECHO:  # the first echo seen stands alone; later ones are averaged in
                echo = pending if echo == NO_ECHO else echo + (pending - echo) * ECHO_RATE
            count, pending = 0, NO_ECHO
        else:
            return share, _run_of(direction, count, quiet + 1), echo, pending
    if abs(z) > TAIL_Z:
        return share, 1.0 if z > 0 else -1.0, echo, NO_ECHO
    return share, 0.0, echo, pending


def pair_surprise(
    z: float, last_z: float, rho: float, nu: float, echo: float = NO_ECHO, previous_max: float = math.inf
) -> float:
    """``-log10 P(both >= m)`` for two consecutive residuals whose smaller one is ``m``, with
    lag-one correlation ``rho``: the first at least ``m``, then the second given the first
    (its conditional mean ``rho`` times the first's expected size beyond ``m``, its sd
    ``sqrt(1 - rho^2)``), and no more than what the first leaves unexplained. After a window
    beyond ``TAIL_Z`` the correlation is at least ``echo`` (``tail_step``).

    Meant for a fault that lasts: two moderate windows, neither remarkable alone, or a wild
    window and the one after it. After a wild window the pair counts only what its echo
    leaves unexplained, so a burst's fading window adds little, while a fault's next window,
    still well above the echo, says the fault goes on. (A window whose rise the engines'
    saturation explained leaves no pair at all: ``LoadConditionedLatency.note_unlearned``.) A model
    that learns no echo (``SeriesLevel``) forms no pair after a window at least
    ``previous_max`` surprising alone: it cannot tell a fault's next window from an echo.

    >>> round(pair_surprise(3.5, 3.6, 0.0, 1000.0), 1), round(pair_surprise(3.5, -0.2, 0.0, 1000.0), 1)
    (7.3, 0.0)
    >>> # What the pair adds to the window alone: after a wild window of 12 sds, 2 sds are
    >>> # mostly its echo; 3.5 sds after one of 6 stand well above it.
    >>> round(pair_surprise(2.0, 12.0, 0.15, 1000.0) - student_surprise(2.0, 1000.0), 1)
    0.4
    >>> round(pair_surprise(3.5, 6.0, 0.15, 1000.0) - student_surprise(3.5, 1000.0), 1)
    2.4
    >>> pair_surprise(3.5, 3.6, 0.5, 1000.0) < pair_surprise(3.5, 3.6, 0.0, 1000.0)
    True
    """
    m = min(z, last_z)
    if m <= 0.0 or student_surprise(last_z, nu) >= previous_max:
        return 0.0
    if last_z > TAIL_Z:  # after a wild window, its echo as the segment's wild windows have shown it
        rho = max(rho, echo)
    rho = min(max(rho, 0.0), 0.9)
    sd = math.sqrt(1.0 - rho * rho)
    # This window given that the previous one was at least m: with heavy tails the previous
    # one was likely well beyond m (on average m nu / (nu - 1) for a power-law tail), and its
    # echo, rho times that, explains part of this one. No higher than its own innovation.
    beyond = nu / (nu - 1.0) if nu < 200.0 else 1.0
    innovation = (z - rho * last_z) / sd
    given = min(m * (1.0 - rho * beyond) / sd, innovation)
    return student_surprise(m, nu) + max(student_surprise(given, nu), 0.0)
