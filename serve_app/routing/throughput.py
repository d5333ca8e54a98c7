"""How fast each engine replica prefills and decodes, learned from what the engines report.

The `ttft` policy turns queued tokens into seconds, so it needs each replica's rates. They are not configured:
hardware, model, tensor parallelism and the engine's batch settings all change them, and a replica slowed by a
noisy neighbour or by long decodes should look slower. So the router measures them from the two reports it gets
per request, "prefill done" (first token) and "finished":

- prefill rate = prefill tokens completed / time during which the replica had at least one request waiting for
  its first token. While a replica has prefill pending it is working on it (continuous batching schedules waiting
  prefills every step), so this is its effective prefill throughput under its current decode mix.
- decode rate = output tokens generated / time during which at least one request was decoding there: the
  aggregate tokens per second its batch produces.

Both are exponentially weighted over busy time (recent minutes count most). A sample is folded in only once it
spans `MIN_SAMPLE_TOKENS`, so a run of tiny, fully cached prompts (whose time is per-step latency, not
throughput) does not read as a slow replica. Before any report a replica starts from the priors, or from the mean
of the replicas already measured (a replica that joins is most likely the same hardware as the others).
"""

from __future__ import annotations

import math

PRIOR_PREFILL_TPS = 10_000.0  # a mid-size model on one modern GPU; only the ratio between replicas matters early on
PRIOR_DECODE_TPS = 2_500.0
HALF_LIFE_S = 60.0  # of busy time: estimates follow a change in a replica's speed within a minute or two
MIN_SAMPLE_TOKENS = 2_048
LOAD_WINDOW_S = 120.0  # time constant of the recent prefill utilization


class RateEstimate:
    """Tokens per second of busy time, exponentially weighted by busy time."""

    __slots__ = ("rate", "tokens", "busy_s", "samples")

    def __init__(self, prior: float):
        self.rate = prior
        self.tokens = 0.0  # since the last fold
        self.busy_s = 0.0
        self.samples = 0  # folds so far (0: still the prior)

    def add(self, tokens: float) -> None:
        self.tokens += tokens
        if self.tokens >= MIN_SAMPLE_TOKENS and self.busy_s > 0.0:
            sample = self.tokens / self.busy_s
            # A sample's weight grows with the busy time it covers: one long window moves the estimate more than
            # a short one, and a window of several half-lives replaces it.
            w = 1.0 - math.exp2(-self.busy_s / HALF_LIFE_S)
            self.rate += w * (sample - self.rate) if self.samples else sample - self.rate
            self.samples += 1
            self.tokens = 0.0
            self.busy_s = 0.0


class Moments:
    """Exponentially weighted mean and second moment; scv = squared coefficient of variation (var / mean^2)."""

    __slots__ = ("m1", "m2", "n")
    ALPHA = 1 / 256  # about the last few hundred observations

    def __init__(self):
        self.m1 = self.m2 = 0.0
        self.n = 0

    def add(self, x: float) -> None:
        a = max(self.ALPHA, 1.0 / (self.n + 1))
        self.m1 += a * (x - self.m1)
        self.m2 += a * (x * x - self.m2)
        self.n += 1

    def scv(self) -> float:
        if self.n < 2 or self.m1 <= 0.0:
            return 1.0  # until measured: the Poisson / exponential value
        return max(0.0, self.m2 / (self.m1 * self.m1) - 1.0)


class ReplicaRates:
    """The prefill and decode rate of one replica, with the busy-time bookkeeping that measures them."""

    __slots__ = ("prefill", "decode", "t", "prefilling", "decoding", "_prefill_busy", "_drained",
                 "_gap", "_work", "_last_arrival", "ttft", "_jitter", "_last_error")

    def __init__(self, prefill_tps: float = PRIOR_PREFILL_TPS, decode_tps: float = PRIOR_DECODE_TPS,
                 now: float = 0.0):
        self.prefill = RateEstimate(prefill_tps)
        self.decode = RateEstimate(decode_tps)
        self.t = now
        self.prefilling = 0  # requests routed here and not yet reported prefilled
        self.decoding = 0  # requests reported prefilled and not yet finished
        # Exponentially decayed (time constant LOAD_WINDOW_S) seconds with prefill pending: recent utilization.
        self._prefill_busy = 0.0
        # Reserved prefill tokens presumed already computed: the backlog drains at the prefill rate while it is
        # pending, though the router only hears of it when a whole request's prefill ends.
        self._drained = 0.0
        # Moments of the gaps between arrivals and of the prefill work per request, for their variability.
        self._gap = Moments()
        self._work = Moments()
        self._last_arrival: float | None = None
        self.ttft = Moments()  # time to first token of the requests routed here, as reported
        # Prediction errors (reported TTFT minus the router's prediction at the decision): the mean square of the
        # change from one error to the next, and the last error.
        self._jitter = Moments()
        self._last_error: float | None = None

    def advance(self, now: float) -> None:
        """Account the time since the last change to whichever phase had work."""
        dt = now - self.t
        if dt > 0.0:
            decay = math.exp(-dt / LOAD_WINDOW_S)
            if self.prefilling:
                self.prefill.busy_s += dt
                self._drained += dt * self.prefill.rate
                # busy for all of dt: the decayed integral of a constant 1 over the interval
                self._prefill_busy = self._prefill_busy * decay + LOAD_WINDOW_S * (1.0 - decay)
            else:
                self._prefill_busy *= decay
            if self.decoding:
                self.decode.busy_s += dt
        self.t = max(self.t, now)

    def prefill_utilization(self, now: float) -> float:
        """Fraction of recent time this replica had a prefill pending."""
        dt = max(0.0, now - self.t)
        decay = math.exp(-dt / LOAD_WINDOW_S)
        busy = self._prefill_busy * decay + (LOAD_WINDOW_S * (1.0 - decay) if self.prefilling else 0.0)
        return busy / LOAD_WINDOW_S

    def backlog(self, reserved: float, now: float) -> float:
        """Prefill tokens still to compute of the `reserved` ones not yet reported prefilled."""
        drained = self._drained
        if self.prefilling:
            drained += max(0.0, now - self.t) * self.prefill.rate
        return max(0.0, reserved - drained)

    def _undrain(self, reserved: float) -> None:
        self._drained = max(0.0, self._drained - reserved) if self.prefilling else 0.0

    # Each transition first advances the clock, so the time before it is charged to the old state.
    def started(self, now: float, tokens: float = 0.0) -> None:
        self.advance(now)
        self.prefilling += 1
        if self._last_arrival is not None:
            self._gap.add(now - self._last_arrival)
        self._last_arrival = now
        self._work.add(tokens)

    def variability(self) -> float:
        """Kingman's (ca^2 + cs^2) / 2: 1 for Poisson arrivals of exponential work, more when either is burstier."""
        return (self._gap.scv() + self._work.scv()) / 2.0

    def prediction_variance(self) -> float:
        """Variance of this replica's TTFT prediction errors from one request to the next (0 until measured).

        Half the mean square of successive differences (von Neumann): the part of the error no prediction can
        follow. A bias that drifts slowly (a backlog the model misjudges in overload) cancels between neighbours;
        the error's plain variance would count that drift as noise.
        """
        return self._jitter.m1 / 2.0

    def prefilled(self, now: float, tokens: float, reserved: float = 0.0, ttft: float | None = None,
                  predicted: float | None = None) -> None:
        """A request's first token: `tokens` were computed, `reserved` leave the backlog; `predicted`: the TTFT
        the router predicted for it here when it chose this replica."""
        self.advance(now)
        if ttft is not None:
            self.ttft.add(ttft)
            if predicted is not None:
                e = ttft - predicted
                if self._last_error is not None:
                    self._jitter.add((e - self._last_error) ** 2)
                self._last_error = e
        self.prefilling = max(0, self.prefilling - 1)
        self._undrain(reserved)
        self.decoding += 1
        self.prefill.add(tokens)

    def finished(self, now: float, output_tokens: float | None, was_prefilled: bool, reserved: float = 0.0) -> None:
        """`output_tokens` None: the request's end was not observed (expired), so it is no measurement.
        `reserved`: prefill tokens it still had reserved (it ended before its first token)."""
        self.advance(now)
        if was_prefilled:
            self.decoding = max(0, self.decoding - 1)
            if output_tokens is not None:
                self.decode.add(output_tokens)
        else:  # ended (failed, cancelled) before its first token: its time measured nothing
            self.prefilling = max(0, self.prefilling - 1)
            self._undrain(reserved)

    def stats(self) -> dict:
        return {"prefill_tps": round(self.prefill.rate, 1), "decode_tps": round(self.decode.rate, 1),
                "rate_samples": self.prefill.samples + self.decode.samples}


def share_measurements(rates: list[ReplicaRates]) -> None:
    """Replicas not yet measured take the measured ones' mean rather than the prior.

    At startup every replica sits at the prior; the first one to report would otherwise look far slower (or
    faster) than its still-unmeasured peers, and requests would leave their cache for a replica that only looks
    fast because nobody has measured it.
    """
    for phase in ("prefill", "decode"):
        measured = [getattr(r, phase).rate for r in rates if getattr(r, phase).samples]
        if measured:
            mean = sum(measured) / len(measured)
            for r in rates:
                est = getattr(r, phase)
                if not est.samples:
                    est.rate = mean


def rates_for_new_replica(known: list[ReplicaRates], now: float) -> ReplicaRates:
    """A joining replica starts from what the measured replicas run at, else from the priors."""
    measured = [r for r in known if r.prefill.samples]
    if not measured:
        return ReplicaRates(now=now)
    p = sum(r.prefill.rate for r in measured) / len(measured)
    d = sum(r.decode.rate for r in measured) / len(measured)
    return ReplicaRates(p, d, now)


SESSION_WINDOW_S = 300.0  # agent sessions last minutes: average their follow-on work over several


class FollowOnWork:
    """Prefill work that a new session brings after its first request, measured over all sessions lately.

    Where a session's first request lands, its later turns follow (their history is cached there), so placing it
    commits that replica to more than this request's prefill. Measured as (decayed) prefill tokens of requests
    from known sessions per (decayed) new session: in a steady stream of sessions, the follow-on work per session,
    whether or not the sessions counted have ended. Zero until sessions are seen (no session keys: no estimate).
    """

    __slots__ = ("_work", "_turns", "_new", "t")

    def __init__(self, now: float = 0.0):
        self._work = 0.0
        self._turns = 0.0
        self._new = 0.0
        self.t = now

    def _decay(self, now: float) -> None:
        if now > self.t:
            d = math.exp(-(now - self.t) / SESSION_WINDOW_S)
            self._work *= d
            self._turns *= d
            self._new *= d
            self.t = now

    def new_session(self, now: float) -> None:
        self._decay(now)
        self._new += 1.0

    def later_turn(self, now: float, prefill_tokens: float) -> None:
        self._decay(now)
        self._work += prefill_tokens
        self._turns += 1.0

    def per_session(self) -> float:
        return self._work / self._new if self._new >= 1.0 else 0.0

    def turns_per_session(self) -> float:
        return self._turns / self._new if self._new >= 1.0 else 0.0


class OfferedWork:
    """Prefill work the router has sent to the fleet lately, in tokens per second (time constant LOAD_WINDOW_S).

    Set against the fleet's measured prefill capacity this says whether the backlog can drain: at or above it the
    queues grow whatever the placement (sustained overload). It counts what was routed, not what was reported
    done: reports arrive at most at the fleet's rate, so they cannot show that more was asked of it.
    """

    __slots__ = ("_tokens", "t")

    def __init__(self, now: float = 0.0):
        self._tokens = 0.0  # decayed sum of routed prefill tokens
        self.t = now

    def add(self, now: float, tokens: float) -> None:
        self._tokens = self._decayed(now) + tokens
        self.t = max(self.t, now)

    def _decayed(self, now: float) -> float:
        return self._tokens * math.exp(-max(0.0, now - self.t) / LOAD_WINDOW_S)

    def rate(self, now: float) -> float:
        # Decayed sum over the window's length: a steady rate r reads r once a window has passed, less before
        # (a router that just started does not read its first burst as overload).
        return self._decayed(now) / LOAD_WINDOW_S
