"""The pool of the partial-rollout modes: prompt groups whose responses are generated in pieces,
across steps, and the ledger of every drawn prompt (the bookkeeping of
`packrl.trainer.stages.partial`).

Shapes: ``G`` members per group (``rollout.n``) · ``n`` tokens a member holds · ``P`` prompt tokens.

The unit is a prompt group (`RolloutGroup`). Each member's response is a list of `Segment`s
(tokens, the engine's log-probs of them, the policy version that sampled them). A member's
response budget is the dispatching step's (`RolloutGroup.dispatch_budget`: the response budget
that applies to it, where its overlong ramp ends, even when a length curriculum has moved on since)
and its cap is fixed then (`RolloutGroup.dispatch_cap`: ``min(dispatch_budget, model context -
P)``, with the finish reason that cap gives, ``length`` or ``context``). A resumed member is granted
at most what is left of the cap (`Member.tokens_left`; each call's grant, `chunk_grant`), counted
from the prompt and the tokens it holds, never from the length of the re-sent input: a resumed
response cannot overrun its budget (verl #7207, slime #2260).
A member finishes with the reason its last segment ended with (``eos``, ``stop``) or, when it
fills its cap, the cap's reason, as an uninterrupted response would (`Member.extended`).

`Ledger` records every prompt drawn from the sampler and what became of it (queued, in flight,
trained at a step, dropped with the reason), so nothing is trained twice or lost across steps and
restarts. Everything here is plain data and JSON-serialisable (`RolloutGroup.to_dict`), written
into the checkpoint's trainer state in the same atomic write as the weights.

Source of the design: AReaL (interruptible generation, arXiv 2505.24298) and verl's
``colocate_async`` (abort and resubmit with the prefix re-prefilled under the new weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from packrl.types import FinishReason, Response


@dataclass(frozen=True)
class Segment:
    """Tokens one engine call added to a member.

    Attributes:
        token_ids: ``[k]`` ids.
        logprobs: the engine's log-prob of each token, ``[k]`` float nats, or None when the
            engine was not asked for them.
        version: the policy version that sampled them (the training step whose weights generated).
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    version: int


@dataclass(frozen=True)
class Member:
    """One response of a group, possibly unfinished.

    Attributes:
        segments: what it holds, in order.
        finish_reason: why it ended, or None while it is unfinished (carried to a later call).
    """

    segments: tuple[Segment, ...] = ()
    finish_reason: FinishReason | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(t for s in self.segments for t in s.token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def tokens_left(self, cap: int) -> int:
        """What the next call may add: the group's cap minus the tokens held."""
        return cap - self.num_tokens

    def extended(self, response: Response, version: int, cap: int, cap_reason: FinishReason) -> Member:
        """This member with ``response`` (one engine call's continuation) appended as a segment.

        It finishes with the response's ``eos`` / ``stop``, or with ``cap_reason`` once it holds
        ``cap`` tokens; a response cut by the call's own smaller cap (a chunk) or aborted by the
        engine leaves it unfinished.

        Raises:
            ValueError: the response would take the member past its cap (an engine that ignored
                the budget it was given).
        """
        total = self.num_tokens + len(response.response_ids)
        if total > cap:
            raise ValueError(f"the engine returned {len(response.response_ids)} tokens for a member holding {self.num_tokens} "
                             f"of its {cap}-token cap; an engine must stop at SamplingParams.max_response_tokens")
        reason: FinishReason | None = None
        if response.finish_reason in ("eos", "stop"):
            reason = response.finish_reason
        elif total == cap:
            reason = cap_reason
        segment = Segment(response.response_ids, response.rollout_logprobs, version)
        return Member(self.segments + ((segment,) if response.response_ids else ()), reason)

    def response(self) -> Response:
        """The finished member as a `Response` with per-token versions (log-probs when every
        segment has them)."""
        assert self.finish_reason is not None, "only a finished member is a response"
        have_logprobs = all(s.logprobs is not None for s in self.segments)
        logprobs = tuple(lp for s in self.segments for lp in (s.logprobs or ())) if have_logprobs else None
        versions = tuple(s.version for s in self.segments for _ in s.token_ids)
        return Response(self.token_ids, self.finish_reason, rollout_logprobs=logprobs, token_versions=versions)


@dataclass(frozen=True)
class RolloutGroup:
    """One prompt and its G members, from dispatch until it is trained or dropped.

    Attributes:
        uid: the draw ordinal of its prompt (`Ledger`), unique across the run.
        prompt_ids, ground_truth, data_source, row, prompt_truncated: the prompt as the sampler
            gave it (`packrl.types.PromptBatch` fields of one prompt).
        seed: the group's sampling seed; member g draws from ``(seed, g)``.
        dispatch_step: the step that first generated for it.
        dispatch_budget: the response budget of that step (``rollout.max_response_tokens``, or
            its length-curriculum stage), in tokens: the budget its responses are scored against.
        dispatch_cap: each member's response cap in tokens, fixed at dispatch:
            ``min(dispatch_budget, model context - prompt)``.
        cap_reason: ``length`` when the cap is the response budget, ``context`` when the model
            context was the smaller.
        members: G members.
        length_target: the response length its prompt asks for (``data.length_target``), or None.
        length_mode: how it asks (``exact`` or ``max``, ``data.length_target.mode_column``), or None.
    """

    uid: int
    prompt_ids: tuple[int, ...]
    ground_truth: str
    data_source: str
    row: int
    prompt_truncated: bool
    seed: int
    dispatch_step: int
    dispatch_budget: int
    dispatch_cap: int
    cap_reason: FinishReason
    members: tuple[Member, ...] = field(default=())
    length_target: int | None = None
    length_mode: str | None = None

    @property
    def complete(self) -> bool:
        return all(m.finished for m in self.members)

    @property
    def num_tokens(self) -> int:
        return sum(m.num_tokens for m in self.members)

    @property
    def started(self) -> bool:
        return any(m.segments for m in self.members)

    def staleness(self, step: int) -> int:
        """Steps between its dispatch and ``step``: the largest staleness its tokens can have."""
        return step - self.dispatch_step

    def with_member(self, index: int, member: Member) -> RolloutGroup:
        members = list(self.members)
        members[index] = member
        return replace(self, members=tuple(members))

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (`from_dict` restores it exactly)."""
        out = {name: getattr(self, name) for name in ("uid", "ground_truth", "data_source", "row", "prompt_truncated", "seed",
                                                      "dispatch_step", "dispatch_budget", "dispatch_cap", "cap_reason",
                                                      "length_target", "length_mode")}
        out["prompt_ids"] = list(self.prompt_ids)
        out["members"] = [{"finish_reason": m.finish_reason,
                           "segments": [[list(s.token_ids), None if s.logprobs is None else list(s.logprobs), s.version]
                                        for s in m.segments]} for m in self.members]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutGroup:
        members = tuple(Member(tuple(Segment(tuple(ids), None if lps is None else tuple(float(x) for x in lps), int(version))
                                     for ids, lps, version in m["segments"]), m["finish_reason"]) for m in data["members"])
        scalars = {k: v for k, v in data.items() if k not in ("prompt_ids", "members", "cap")}
        if "cap" in data:  # a checkpoint written before the cap and the budget had names of their own: the cap was both
            scalars |= {"dispatch_cap": data["cap"], "dispatch_budget": data["cap"]}
        return cls(**scalars, prompt_ids=tuple(data["prompt_ids"]), members=members)

    def chunk_grant(self, member: int, chunk_tokens: int) -> int:
        """Tokens one engine call may add to ``member``: a chunk of ``chunk_tokens``
        (``rollout.partial_chunk_tokens``), at most what is left of the dispatch cap."""
        return min(chunk_tokens, self.members[member].tokens_left(self.dispatch_cap))


TRAINED, DROPPED, QUEUED, IN_FLIGHT = "trained", "dropped", "queued", "in_flight"


@dataclass
class Ledger:
    """What became of every prompt drawn from the sampler: uid -> ``queued`` (drawn, not yet
    generated), ``in_flight`` (generating or finished but untrained), ``trained@<step>`` or
    ``dropped@<step>:<reason>``. The controller is its only writer.

    Attributes:
        states: uid -> state, for uids 0 .. len - 1.
    """

    states: dict[int, str] = field(default_factory=dict)

    def draw(self) -> int:
        """Record a newly drawn prompt as queued; returns its uid."""
        uid = len(self.states)
        self.states[uid] = QUEUED
        return uid

    def mark(self, uid: int, state: str, step: int | None = None, reason: str = "") -> None:
        """Move ``uid`` to ``state``; a trained or dropped uid never moves again.

        Raises:
            RuntimeError: ``uid`` was never drawn, or is already trained or dropped (it would be
                trained twice or come back from the dead).
        """
        held = self.states.get(uid)
        if held is None or held.startswith((TRAINED, DROPPED)):
            raise RuntimeError(f"ledger: prompt uid {uid} is {held or 'not drawn'}; it cannot become {state}")
        self.states[uid] = state if step is None else f"{state}@{step}" + (f":{reason}" if reason else "")

    def counts(self) -> dict[str, int]:
        """Prompts per state kind (``queued``, ``in_flight``, ``trained``, ``dropped``)."""
        out = {QUEUED: 0, IN_FLIGHT: 0, TRAINED: 0, DROPPED: 0}
        for state in self.states.values():
            out[state.split("@", 1)[0]] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"states": [self.states[uid] for uid in range(len(self.states))]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Ledger:
        return cls(dict(enumerate(data["states"])))
