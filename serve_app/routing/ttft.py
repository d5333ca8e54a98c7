"""The `ttft` policy: send each request where it costs the least time to first token, its own and others'.

Per candidate replica, in seconds, from that replica's measured rates (routing/throughput.py):

    cost = wait                                  this request's predicted TTFT there
         + delay x (uncached + follow-on) / P    what its prefill (and its session's) adds to others' waits
         + later turns x typical TTFT there      its session's own future turns, when this is a new session

- wait = (backlog + uncached) / P + decode interleaved. backlog: prefill tokens routed there and not yet reported
  prefilled, less what the replica has presumably computed since (it drains at P while pending); uncached: prompt
  tokens beyond the leading blocks that replica holds (KV index); P: its measured prefill rate. The backlog is
  every queued request's, whatever its tenant's tier: vLLM's priority scheduling reorders only requests still
  waiting for a slot or KV memory, and an admitted one keeps its place; letting a higher tier skip lower tiers'
  backlog routed worse in the simulation (README "Tenants and state", load/results/router_tiers.json). With
  continuous batching running decodes share the prefill's steps (one token per running request per step, about
  `(backlog + uncached) / step_tokens` steps), so they add `decoding x steps` tokens at the decode rate.
- delay: how many seconds of others' waiting one more second of work there causes. The M/M/1 marginal,
  rho (2 - rho) / (1 - rho)^2 at the replica's recent prefill utilization rho, scaled by Kingman's variability
  (ca^2 + cs^2) / 2 of its arrivals and prefill sizes (bursty traffic queues more). Zero on an idle replica:
  recomputing a prefix costs nobody else then; steep near saturation, where recomputation is what tips it over.
- cached: the leading blocks the replica holds (KV index); on the session's replica also those of its previous
  request when that is still in flight there (queued or running): the engine admits in order, so they will be
  computed before this one is admitted, though no KV event has said so yet. Without this a session whose turns
  come faster than its replica serves them (open-loop clients, overload) looks uncached at home and moves.
- follow-on, later turns: a session's first request decides where its later turns go (their history will be
  cached there). The router measures, over recent sessions, the prefill work and the number of requests that
  follow a session's first one (only with session keys: X-Claude-Code-Session-Id, prompt_cache_key ...), and
  the replica's typical TTFT from the reports.

What this does, without a weight to tune: a hot shared prefix stays on the replicas that hold it until the queue
there costs more than computing it elsewhere (for this request and those it delays), then it spreads, and new
sessions go where their whole future is cheapest, not only their first turn. A session's later turns stay where
its history is cached, unless that replica is so backed up that recomputing the history elsewhere is faster
even counting what the recomputation does to others. A move away from cached blocks must also beat staying by
more than the predictions' own error: the router measures, per replica, how far each request's reported TTFT
fell from what it predicted at the decision, and a replica that keeps more of the prompt cached and is predicted
within that spread (the standard deviation of the difference of two predictions) of the best is preferred; the
blocks left behind are recomputed for sure, the gain is not. The spread is the error's jitter from one request
to the next (successive differences), not its plain variance: a bias that drifts slowly, as in overload, moves
every prediction alike and is not noise between two replicas. Within one block's prefill time of the best the
predictions are equal: the session's last replica wins, then the larger cached prefix, then fewer requests in
flight, then the replica that wrote the least new cache lately.

Sustained overload is different. When the prefill work routed to the fleet lately (tokens per second, over the
utilization window) reaches the fleet's measured prefill capacity, the queues grow whatever the placement: the
M/M/1 marginal is undefined there (it is capped), and every token recomputed is capacity taken from a fleet that
has none to spare, so hit rate is throughput. The policy then routes work first: only the replicas that would
compute the least (within one block) are candidates, which keeps a session on its history and a shared prefix
where it is cached, and among them the lowest predicted TTFT wins (the costs of the future are the fleet's, the
same wherever the request goes). Once the routed work falls below capacity the backlog drains and the full
cost, recomputation included, is used again. The signal is a comparison of two measured rates, not a weight.
"""

from __future__ import annotations

import math

from serve_app.routing.policies import Policy, _tie_break, prefill_left

DEFAULT_STEP_TOKENS = 8192  # vLLM's max_num_batched_tokens for online serving: prefill tokens per engine step


class TtftPolicy(Policy):
    name = "ttft"

    def choose(self, state, req, candidates):
        bs = state.block_size
        n, overlaps, uncached_by = prefill_left(state, req, candidates)
        home = state.session_replica(req.session_key)
        if home in overlaps:
            # The session's previous request may still be queued or running there: its prompt is as good as cached.
            k = state.session_inflight_blocks(req.session_key, home, req.block_hashes)
            if k > overlaps[home]:
                overlaps[home] = k
                uncached_by[home] = n - min(k * bs, n)
        step_tokens = getattr(state, "step_tokens", DEFAULT_STEP_TOKENS)
        now = state.now()
        # A session's first request also decides where its later turns go (their history will be cached there).
        follow_on = later_turns = 0.0
        if req.session_key is not None and home is None:
            follow_on = state.follow_on.per_session()
            later_turns = state.follow_on.turns_per_session()
        predicted = {}
        if fleet_overloaded(state, now):
            # Work first: recomputation takes capacity the fleet does not have; then this request's own TTFT.
            least = min(uncached_by[r] for r in candidates)
            candidates = [r for r in candidates if uncached_by[r] <= least + bs]
            for rid in candidates:
                predicted[rid] = predict_ttft(state, rid, uncached_by[rid], step_tokens)
        for rid in candidates if not predicted else ():
            uncached = uncached_by[rid]
            wait = predict_ttft(state, rid, uncached, step_tokens)
            rates = state.rates[rid]
            others = delay_factor(rates.prefill_utilization(now)) * rates.variability()
            predicted[rid] = (wait + others * (uncached + follow_on) / rates.prefill.rate
                              + later_turns * rates.ttft.m1)
        lead = min(candidates, key=predicted.__getitem__)
        best = predicted[lead]
        # Leaving cached blocks for a lower prediction must beat staying by more than the predictions' own error:
        # a smaller gain is as likely noise as real, and the blocks left behind are recomputed for sure. So the
        # replicas that keep more of the prompt cached and are predicted within that error of the best compete
        # among themselves.
        keep = [r for r in candidates if overlaps[r] > overlaps[lead]
                and predicted[r] <= best + prediction_spread(state, lead, r)]
        if keep:
            lead = min(keep, key=predicted.__getitem__)
            best = predicted[lead]
            candidates = [r for r in candidates if overlaps[r] >= overlaps[lead]]
        # One block's prefill on the fastest replica: below that the difference is not real work.
        band = bs / max(state.rates[r].prefill.rate for r in candidates)
        tied = [r for r in candidates if predicted[r] <= best + band]
        if home not in tied:
            # Equal predictions: keep the larger cached prefix (it serves this session's next turn too).
            most = max(overlaps[r] for r in tied)
            tied = [r for r in tied if overlaps[r] == most]
        rid = _tie_break(state, req, tied)
        return rid, overlaps[rid]


def predict_ttft(state, rid: str, uncached: int, step_tokens: int = DEFAULT_STEP_TOKENS) -> float:
    """Seconds until `uncached` more prompt tokens routed to `rid` would produce their first token."""
    load = state.loads[rid]
    rates = state.rates[rid]
    prefill_tokens = rates.backlog(load.active_prefill_tokens, state.now()) + uncached
    prefill_s = prefill_tokens / rates.prefill.rate
    steps = max(1, math.ceil(prefill_tokens / step_tokens))
    # Decode tokens that share those steps; no more than the running requests are expected to produce.
    interleaved = min(rates.decoding * steps, load.active_decode_tokens)
    return prefill_s + interleaved / rates.decode.rate


def prediction_spread(state, a: str, b: str) -> float:
    """Standard deviation of the difference between two replicas' TTFT predictions, from their measured errors.

    Each replica's error (reported TTFT minus the prediction at the decision) is measured on the requests routed
    there; taken as independent, the difference of two predictions is off by sqrt(var_a + var_b).
    """
    return math.sqrt(state.rates[a].prediction_variance() + state.rates[b].prediction_variance())


def fleet_overloaded(state, now: float) -> bool:
    """The fleet is asked for prefill work at least as fast as it measurably does it: its backlog cannot drain."""
    offered = getattr(state, "offered", None)
    if offered is None or not state.rates:
        return False
    return offered.rate(now) >= sum(r.prefill.rate for r in state.rates.values())


MAX_UTILIZATION = 0.95  # keeps the delay factor finite on a saturated replica


def delay_factor(rho: float) -> float:
    """Seconds of waiting that one more second of work on a replica at utilization `rho` costs the others.

    M/M/1: requests waiting L = rho^2 / (1 - rho); work added over a horizon raises rho, and the total waiting
    grows by dL/drho = rho (2 - rho) / (1 - rho)^2 per second of work. Zero on an idle replica, steep near
    saturation, where recomputing what is cached elsewhere is what tips a replica over.
    """
    rho = min(max(rho, 0.0), MAX_UTILIZATION)
    return rho * (2.0 - rho) / (1.0 - rho) ** 2
