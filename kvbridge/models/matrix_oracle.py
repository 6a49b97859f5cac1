"""The restore oracle, as the compatibility matrix asks it of one path: warm answers against a cold one.

Place in the flow: `python -m kvbridge.models.matrix` -> a path (matrix_paths.py) runs its steps ->
**Oracle** keeps each step's record beside the cold answer -> a verdict for the row.

A row is "exact" only when every warm step restored something (matched_tokens > 0), its greedy tokens
equal the cold prefill's, and its notes name none of the fallbacks ("refused", "uncached", "snapshot");
"refused" quotes the engine's refusal or error; "differs" says which step differed and where. What
llama.cpp's own reuse gives (native) is asked only when a warm answer differs from cold: a warm
answer equal to native's is "exact (as native)", the model matrix's rule.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

FALLBACK_WORDS = ("refused", "uncached", "snapshot")
VERDICTS = ("exact", "exact (as native)", "refused", "differs")

# A document long enough for several chunks and several sliding windows at test size (n_swa 32);
# matrix_paths.prompt_of repeats it to the length a size asks for.
DOCUMENT = ("In the beginning of the long report, the committee described how the river changed course after "
            "the storm, how farmers moved their herds to higher ground, and why the old bridge was closed. ")
QUESTION = "Question: what happened to the bridge, and why?"
FOLLOW_UP = " And what did the farmers do next?"
FILLER = "Completely unrelated filler text about databases, tea and the migration of birds. " * 4


@dataclass
class Step:
    """One warm request of a path, against its cold answer."""

    name: str
    matched_tokens: int
    prompt_tokens: int
    tier: str
    equal: bool
    first_difference: int = -1   # token index (of the generated text's pieces) where warm left cold; -1 none
    notes: str = ""
    error: str = ""

    @property
    def fallback(self) -> str:
        found = [word for word in FALLBACK_WORDS if word in self.notes.lower()]
        return ", ".join(found)


@dataclass
class Row:
    """architecture x path -> verdict, with the steps that decided it."""

    arch: str
    path: str
    verdict: str = ""
    reason: str = ""
    steps: list[Step] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        out["seconds"] = round(self.seconds, 1)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Row":
        steps = [Step(**s) for s in data.get("steps", [])]
        return cls(arch=data["arch"], path=data["path"], verdict=data.get("verdict", ""),
                   reason=data.get("reason", ""), steps=steps, seconds=data.get("seconds", 0.0))

    def refuse(self, reason: str) -> "Row":
        self.verdict, self.reason = "refused", one_line(reason)
        return self


def one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def top_margin(logits) -> float:
    """The top-1 minus the top-2 logit: how far a greedy choice is from a tie (random weights make it thin, so
    a restore is judged by its logits bit for bit, and this says how much room the text's equality had)."""
    import numpy as np

    top2 = np.partition(np.asarray(logits, dtype=np.float64), -2)[-2:]
    return float(top2[1] - top2[0])


def first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


class Oracle:
    """Collects a path's steps against cold answers (by prompt) and decides the row's verdict."""

    def __init__(self, row: Row):
        self.row = row
        self.cold: dict[str, str] = {}
        self._warm: dict[str, tuple[str, str]] = {}   # step name -> (prompt, warm text), never written out

    def set_cold(self, prompt: str, record) -> bool:
        """A cold answer to compare with; False (and the row refused) when the cold request itself failed."""
        if record.error:
            self.row.refuse(f"cold prefill failed: {record.error}")
            return False
        self.cold[prompt] = record.text
        return True

    def check(self, name: str, prompt: str, record) -> Step:
        cold = self.cold[prompt]
        step = Step(name=name, matched_tokens=record.matched_tokens, prompt_tokens=record.prompt_tokens,
                    tier=record.tier, equal=(record.text == cold and not record.error),
                    first_difference=first_difference(record.text, cold), notes=one_line(record.notes),
                    error=one_line(record.error))
        self._warm[name] = (prompt, record.text)
        self.row.steps.append(step)
        return step

    def decide(self, native_of=None) -> Row:
        """The verdict from the steps; native_of(prompt) -> native text is asked only for a differing step."""
        row = self.row
        if row.verdict:
            return row
        errors = [s for s in row.steps if s.error]
        if errors:
            return row.refuse(f"{errors[0].name}: {errors[0].error}")
        refused = [s for s in row.steps if "refused" in s.notes.lower()]
        if refused and not any(s.matched_tokens for s in row.steps):
            return row.refuse(refused[0].notes)
        differing = [s for s in row.steps if not s.equal]
        if differing:
            s = differing[0]
            as_native = self._equal_to_native(differing, native_of)
            if not as_native:
                row.verdict = "differs"
                row.reason = one_line(f"{s.name}: warm text differs from cold at character {s.first_difference} "
                                      f"({s.matched_tokens} of {s.prompt_tokens} tokens restored, tier {s.tier})")
                return row
        missed = [s for s in row.steps if s.matched_tokens <= 0]
        if missed:
            return row.refuse(f"{missed[0].name}: nothing restored" + (f" ({missed[0].notes})" if missed[0].notes else ""))
        fallback = [s for s in row.steps if s.fallback]
        if fallback:
            return row.refuse(f"{fallback[0].name}: notes say {fallback[0].fallback}: {fallback[0].notes}")
        row.verdict = "exact (as native)" if differing else "exact"
        row.reason = ", ".join(f"{s.name}: {s.matched_tokens}/{s.prompt_tokens} from {s.tier}" for s in row.steps)
        return row

    def _equal_to_native(self, differing: list[Step], native_of) -> bool:
        """Every differing warm answer equals what llama.cpp's own reuse gives for its prompt."""
        if native_of is None:
            return False
        for step in differing:
            prompt, warm = self._warm[step.name]
            if native_of(prompt) != warm:
                return False
        return True
