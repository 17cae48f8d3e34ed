"""Recorded decoding rounds: the labelled data that survival maps are fitted and scored on.

A record is one round of one request whose whole draft block was verified: its signals [γ, 3]
(`dspark.calibration.signals`), how many drafts the block had (`available`) and how many of them the
target accepted (`accepted`). Labels follow: draft k survived iff accepted ≥ k (cumulative); given that
drafts 1..k−1 survived, draft k survived iff accepted ≥ k (conditional). Each round also keeps the index of
the prompt it came from within its domain (`prompt`, −1 where unknown): rounds of one request are
correlated, so uncertainty is estimated by resampling prompts, not rounds (`metrics.ece_std_error`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch

from dspark.atomic import write_bytes_atomic
from dspark.calibration.signals import NUM_SIGNALS

RECORDS_FORMAT = "dspark-round-records"


@dataclass
class RoundRecords:
    """n recorded rounds: signals [n, γ, 3] float32, available [n], accepted [n], greedy [n] bool, domain [n],
    prompt [n] long (the prompt's index within its domain; −1 where unknown, the default)."""

    signals: torch.Tensor
    available: torch.Tensor
    accepted: torch.Tensor
    greedy: torch.Tensor
    domain: list[str] = field(default_factory=list)
    prompt: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = self.signals.shape[0]
        if self.signals.dim() != 3 or self.signals.shape[2] != NUM_SIGNALS:
            raise ValueError(f"signals must be [n, γ, {NUM_SIGNALS}], got {list(self.signals.shape)}")
        self.prompt = torch.full((n,), -1, dtype=torch.long) if self.prompt is None else self.prompt.long()
        for name in ("available", "accepted", "greedy", "prompt"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"{name} must have shape [{n}], got {list(getattr(self, name).shape)}")
        if not self.domain:
            self.domain = [""] * n
        if len(self.domain) != n:
            raise ValueError(f"domain has {len(self.domain)} entries for {n} rounds")
        if bool((self.accepted > self.available).any()):
            raise ValueError("a round accepted more drafts than it had")

    def __len__(self) -> int:
        return self.signals.shape[0]

    @property
    def gamma(self) -> int:
        """Block width γ."""
        return self.signals.shape[1]

    def without_greedy_peaks(self) -> "RoundRecords":
        """These rounds with greedy rows' drafting-distribution signals (max_q, entropy: the peak) set to NaN, so
        a map fitted on them gives greedy rows a per-position prior (what the shipped maps without peaks do)."""
        from dspark.calibration.signals import ENTROPY, MAX_Q

        signals = self.signals.clone()
        rows = self.greedy.bool()
        signals[rows, :, MAX_Q] = float("nan")
        signals[rows, :, ENTROPY] = float("nan")
        return RoundRecords(signals, self.available, self.accepted, self.greedy, list(self.domain), self.prompt)

    def subset(self, mask: torch.Tensor | Sequence[bool]) -> "RoundRecords":
        """The rounds where mask is true."""
        m = torch.as_tensor(mask, dtype=torch.bool)
        return RoundRecords(self.signals[m], self.available[m], self.accepted[m], self.greedy[m],
                            [d for d, keep in zip(self.domain, m.tolist()) if keep], self.prompt[m])

    def domains(self) -> list[str]:
        """Distinct domain labels in order of first appearance."""
        return list(dict.fromkeys(self.domain))

    def clusters(self) -> torch.Tensor:
        """[n] long: one id per (domain, prompt) pair, the unit that resampling draws; a round of an unknown
        prompt (−1) is a cluster of its own."""
        ids: dict[tuple[str, int], int] = {}
        out = []
        for i, (d, p) in enumerate(zip(self.domain, self.prompt.tolist())):
            key = (d, p) if p >= 0 else ("", -1 - i)
            out.append(ids.setdefault(key, len(ids)))
        return torch.tensor(out, dtype=torch.long)

    def cumulative_labels(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(labels [n, γ] float: accepted ≥ k, valid [n, γ] bool: k ≤ available)."""
        k = torch.arange(1, self.gamma + 1).view(1, -1)
        return (self.accepted.view(-1, 1) >= k).float(), k <= self.available.view(-1, 1)

    def conditional_labels(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(labels [n, γ] float: accepted ≥ k, valid [n, γ] bool: k ≤ available and accepted ≥ k − 1)."""
        labels, valid = self.cumulative_labels()
        k = torch.arange(1, self.gamma + 1).view(1, -1)
        return labels, valid & (self.accepted.view(-1, 1) >= k - 1)

    @classmethod
    def concat(cls, parts: Iterable["RoundRecords"]) -> "RoundRecords":
        """Join records of the same γ."""
        parts = [p for p in parts if len(p)]
        if not parts:
            raise ValueError("no rounds to join")
        widths = {p.gamma for p in parts}
        if len(widths) != 1:
            raise ValueError(f"records of different block widths cannot be joined: {sorted(widths)}")
        return cls(torch.cat([p.signals for p in parts]), torch.cat([p.available for p in parts]),
                   torch.cat([p.accepted for p in parts]), torch.cat([p.greedy for p in parts]),
                   [d for p in parts for d in p.domain], torch.cat([p.prompt for p in parts]))

    def save(self, path: str | Path) -> Path:
        """Write the rounds as safetensors (the domain labels in its metadata), atomically."""
        from safetensors.torch import save

        tensors = {"signals": self.signals.float().cpu().contiguous(), "available": self.available.long().cpu(),
                   "accepted": self.accepted.long().cpu(), "greedy": self.greedy.to(torch.uint8).cpu(),
                   "prompt": self.prompt.long().cpu()}
        meta = {"format": RECORDS_FORMAT, "version": "1", "domain": json.dumps(list(self.domain))}
        return write_bytes_atomic(path, save(tensors, metadata=meta))

    @classmethod
    def load(cls, path: str | Path) -> RoundRecords:
        """Read rounds written by `save`; a missing, truncated or malformed file raises ValueError naming it."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        p = Path(path)
        if not p.is_file():
            raise ValueError(f"round records file {p} does not exist")
        raw = p.read_bytes()
        try:
            tensors = load(raw)
            header_len = int.from_bytes(raw[:8], "little")
            meta = json.loads(raw[8 : 8 + header_len]).get("__metadata__", {})
        except (SafetensorError, ValueError, json.JSONDecodeError) as err:
            raise ValueError(f"round records file {p} cannot be read (truncated or not safetensors): {err}") from None
        if meta.get("format") != RECORDS_FORMAT:
            raise ValueError(f"round records file {p} is not a dspark round records file (field 'format' is "
                             f"{meta.get('format')!r})")
        missing = [k for k in ("signals", "available", "accepted", "greedy") if k not in tensors]
        if missing or "domain" not in meta:
            raise ValueError(f"round records file {p} lacks field(s) {missing or ['domain']}")
        try:
            return cls(tensors["signals"], tensors["available"], tensors["accepted"], tensors["greedy"].bool(),
                       list(json.loads(meta["domain"])), tensors.get("prompt"))  # files before prompt ids: None
        except (ValueError, TypeError, json.JSONDecodeError) as err:
            raise ValueError(f"round records file {p} is malformed: {err}") from None


def records_from_results(results, temperatures: Sequence[float] | float, domain: str = "",
                         first_prompt: int = 0) -> RoundRecords:
    """Rounds of `decode` results run with record_signals=True whose whole block was verified; results[i] is
    prompt first_prompt + i of its domain.

    Rounds that drafted nothing, or whose block the scheduler cut (draft_len < available), are left out:
    their labels past the cut are unknown.
    """
    temps = [temperatures] * len(results) if isinstance(temperatures, (int, float)) else list(temperatures)
    sig, avail, acc, greedy, prompt = [], [], [], [], []
    gamma = max((len(s.signals) for r in results for s in r.rounds if s.signals), default=0)
    for i, (res, temp) in enumerate(zip(results, temps)):
        for s in res.rounds:
            if not s.signals or s.available is None or s.draft_len != s.available:
                continue
            row = torch.full((gamma, NUM_SIGNALS), float("nan"))
            row[: len(s.signals)] = torch.tensor(s.signals, dtype=torch.float32)
            sig.append(row)
            avail.append(s.available)
            acc.append(s.accepted)
            greedy.append(temp == 0)
            prompt.append(first_prompt + i)
    if not sig:
        return RoundRecords(torch.zeros(0, gamma, NUM_SIGNALS), torch.zeros(0, dtype=torch.long),
                            torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool), [])
    return RoundRecords(torch.stack(sig), torch.tensor(avail), torch.tensor(acc), torch.tensor(greedy),
                        [domain] * len(sig), torch.tensor(prompt, dtype=torch.long))
