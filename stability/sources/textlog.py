"""Streaming parser of training stdout logs: Megatron-LM / Megatron-DeepSpeed, DeepSpeed, HF Trainer prints,
fairseq, nanoGPT / llm.c style lines, and the system lines of :mod:`stability.sources.system`.

One pass, line by line (a 1M-line log is never held in memory); each recognised line becomes a record or an
event:

* ``iteration N/ M | key: value | ...`` (Megatron; also ``Step N | Key: value | ...``): one record, every numeric
  field a signal (:func:`signal_name`: ``lm loss`` -> ``loss``, ``grad norm`` -> ``grad_norm``, ``loss scale`` ->
  ``loss_scale``, ``number of skipped iterations`` -> ``skipped``, other losses by their own names). The argument
  dump (``---- arguments ----`` ... ``---- end of arguments ----``) and ``using world size: ...`` are start-up
  context; a new dump after records is a new segment (a restart), ``loading checkpoint ... at iteration N`` an
  event.
* DeepSpeed: ``OVERFLOW! Rank R Skipping step. Attempted loss scale: A, reducing to B`` (or ``..., but hysteresis
  is H. Reducing hysteresis to H-1``: the scale stays A) (an ``overflow`` event;
  the next record is marked ``skipped`` and gets ``loss_scale`` = B when it prints none), ``step=N, skipped=K,
  lr=[...]`` (a record: ``lr``, and ``skipped`` = the increase of K), ``Current loss scale already at minimum``
  (``scale_minimum``), ``DeepSpeed info: version=...`` (context, a start-up banner).
* HF Trainer: printed dicts ``{'loss': ..., 'grad_norm': ..., 'learning_rate': ..., 'epoch': ...}``; the step is
  the last tqdm counter (``378/2724 [...``) seen, else the dict's ordinal (noted). ``***** Running training *****``
  is a start-up banner.
* fairseq: ``train_inner`` lines (``key=value, ...``, step = ``num_updates``), epoch summaries (``| key value |``),
  ``valid`` summaries (``val_`` signals), ``overflow detected, setting loss scale to: X`` and ``Minimum loss scale
  reached``.
* nanoGPT ``iter N: loss X, time ...`` (and user prints ``step N loss X``) and llm.c / modded-nanogpt
  ``step:N/M train_loss:X`` / ``s:N trl:X``.
* system lines anywhere (Xid, ECC, hung task, OOM, NCCL watchdog) and ``Traceback`` / fatal errors (``crash``).

Lines starting with ``# `` are comments (provenance headers of fixture files).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from stability.records import StepRecord
from stability.sources import system
from stability.sources._model import LogEvent
from stability.sources._segments import SegmentBuilder

__all__ = ["TextLogParser", "line_format", "signal_name"]

_ALIASES = {
    "lm loss": "loss", "loss": "loss", "train_loss": "loss", "train loss": "loss", "trl": "loss",
    "grad norm": "grad_norm", "gnorm": "grad_norm", "grad_norm": "grad_norm", "gradnorm": "grad_norm",
    "norm": "grad_norm", "global grad norm": "grad_norm",
    "learning rate": "lr", "lr": "lr", "learning_rate": "lr",
    "loss scale": "loss_scale", "loss_scale": "loss_scale", "scale": "loss_scale",
    "number of skipped iterations": "skipped", "number of nan iterations": "nan_iters",
    "params norm": "params_norm", "num zeros": "num_zeros",
    "consumed samples": "consumed_samples", "consumed tokens": "consumed_tokens",
    "global batch size": "global_batch_size", "elapsed time per iteration (ms)": "iter_time_ms",
    "valid_loss": "val_loss", "val_loss": "val_loss", "eval_loss": "val_loss", "tel": "val_loss",
    "time": "iter_time_ms",
}
_SANITIZE = re.compile(r"[^a-z0-9]+")


def signal_name(key: str) -> str:
    """The record signal name of a log field (see the module docstring); never contains ``/``."""
    name = _NAMES.get(key)
    if name is None:
        name = _signal_name(key)
        if len(_NAMES) < _NAMES_MAX:
            _NAMES[key] = name
    return name


_NAMES: dict[str, str] = {}
"""Field text as printed -> signal name: a log prints the same few fields on every line (a 1M-line log names each
once, not once a line)."""
_NAMES_MAX = 10_000


def _signal_name(key: str) -> str:
    key = key.strip().lower()
    alias = _ALIASES.get(key)
    if alias is not None:
        return alias
    return _SANITIZE.sub("_", key).strip("_")


def _number(text: str) -> float | None:
    try:  # the common case: a plain number (float ignores the surrounding blanks the slow path strips)
        return float(text)
    except ValueError:
        pass
    text = text.strip().rstrip("|,").strip()
    if text.endswith("ms") and text[:-2].replace(".", "", 1).isdigit():
        text = text[:-2]
    try:
        return float(text)
    except ValueError:
        return None


_ITERATION = re.compile(r"\b(?:iteration|Step)\s+(\d+)\s*(?:/\s*(\d+))?\s*\|(.*)")
_ARGS_START = re.compile(r"^-{3,}\s*arguments\s*-{3,}\s*$")
_ARGS_END = re.compile(r"^-{3,}\s*end of arguments\s*-{3,}\s*$")
_ARG_LINE = re.compile(r"^\s*(\S+)\s+\.{2,}\s+(.*?)\s*$")
_WORLD = re.compile(r"using world size:\s*(\d+)(.*)")
_SIZES = re.compile(r"([a-z\- ]+?) size:\s*(\d+)")
_CKPT = re.compile(r"loading checkpoint (?:from .* )?at iteration (\d+)|loaded checkpoint .*? at iteration (\d+)")
_OVERFLOW = re.compile(r"Attempted loss scale:\s*([0-9.eE+\-]+),\s*(?:reducing to\s*([0-9.eE+\-]+)|but hysteresis)")
_DS_RANK = re.compile(r"OVERFLOW! Rank (\d+)")
_DS_STEP = re.compile(r"\bstep=(\d+),\s*skipped=(\d+),\s*lr=\[([^\]]*)\]")
_DS_VERSION = re.compile(r"DeepSpeed info: version=([^,\s]+)")
_MINIMUM = re.compile(r"loss scale already at minimum|Minimum loss scale reached", re.IGNORECASE)
_FAIRSEQ_OVERFLOW = re.compile(r"overflow detected, setting loss scale to:\s*([0-9.eE+\-]+)")
_DICT = re.compile(r"\{'[^{}]*\}")
_DICT_PAIR = re.compile(r"'([^']+)':\s*([^,}]+)")
_TQDM = re.compile(r"(\d+)/(\d+) \[")
_FAIRSEQ_INNER = re.compile(r"epoch (\d+):\s+(\d+)\s*/\s*(\d+)\s+(\w+=.*)")
_FAIRSEQ_SUMMARY = re.compile(r"(?:^|\|)\s*(?:train \| )?epoch \d+ \|(.*)")
_NANOGPT = re.compile(r"^(?:iter|step) (\d+):? loss[:=]? ?([^,\s]+)(?:, time ([0-9.]+)ms)?")
_LLMC = re.compile(r"^(?:step|s):(\d+)(?:/\d+)?\s+(.*)")
_KV_COLON = re.compile(r"(\w+):(\S+)")
_CRASH = re.compile(r"^Traceback \(most recent call last\)|FloatingPointError|RuntimeError: CUDA error|"
                    r"CUDA error: an illegal memory access|Segmentation fault")
_VERSIONS = re.compile(r"\b(torch|deepspeed|transformers|megatron|apex|cuda|nccl)(?:[ _]version)?\s*[=:]\s*"
                       r"v?([0-9][0-9A-Za-z.+\-]*)", re.IGNORECASE)
_BANNER_HF = "***** Running training *****"

FORMATS = ("megatron", "deepspeed", "hf-trainer", "fairseq", "nanogpt", "system")


def line_format(line: str) -> str | None:
    """Which log format one line belongs to (for sniffing), or None."""
    if _ITERATION.search(line) or _ARGS_START.match(line.strip()):
        return "megatron"
    if "OVERFLOW!" in line or _DS_STEP.search(line) or "DeepSpeed info" in line:
        return "deepspeed"
    if _DICT.search(line) and ("'loss'" in line or "'eval_loss'" in line or "'grad_norm'" in line):
        return "hf-trainer"
    if _FAIRSEQ_INNER.search(line) or ("| epoch" in line and "num_updates" in line) or _FAIRSEQ_OVERFLOW.search(line):
        return "fairseq"
    if _NANOGPT.match(line.strip()) or (_LLMC.match(line.strip()) and ("loss" in line or "trl:" in line)):
        return "nanogpt"
    if system.classify(line) is not None:
        return "system"
    return None


@dataclass
class TextLogParser:
    """Parse one text log (see the module docstring); feed lines with :meth:`feed` or a file with :meth:`read`."""

    run_id: str
    source: str
    host: str = ""
    rank: int = 0
    year: int | None = None
    builder: SegmentBuilder = field(default_factory=SegmentBuilder)
    events: list[LogEvent] = field(default_factory=list)
    context: dict[str, str] = field(default_factory=dict)
    formats: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    _line_no: int = 0
    _in_args: bool = False
    _args: dict[str, str] = field(default_factory=dict)
    _tqdm_step: int | None = None
    _ordinal: int = 0
    _pending_skips: int = 0
    _pending_scale: float | None = None
    _streak: int = 0
    _last_overflow: tuple[float, set[int]] | None = None
    _ds_skipped: dict[int, int] = field(default_factory=dict)
    _last_step: int | None = None
    _ordinal_noted: bool = False
    _layout: tuple[re.Pattern[str], tuple[str, ...]] | None = None
    """The pattern and field names of the last Megatron line layout (:func:`_layout`)."""

    def read(self, path: Path) -> None:
        """Parse a whole file, streaming."""
        with path.open(encoding="utf-8", errors="replace") as handle:
            for line in handle:
                self.feed(line)

    def feed_all(self, lines: Iterable[str]) -> None:
        """Parse lines in order."""
        for line in lines:
            self.feed(line)

    def feed(self, raw: str) -> None:
        """Parse one line."""
        self._line_no += 1
        line = raw.rstrip("\r\n")
        if line.startswith("# "):
            return
        # tqdm redraws with carriage returns: the last counter on the line is the current step
        if "/" in line and "[" in line:
            counters = _TQDM.findall(line)
            if counters:
                self._tqdm_step = int(counters[-1][0])
        stripped = line.strip()
        if self._in_args:
            self._arg_line(stripped)
            return
        if not stripped:
            return
        for handler in (self._megatron, self._deepspeed, self._hf, self._fairseq, self._nanogpt):
            if handler(line, stripped):
                return
        self._other(line)

    # -- helpers -------------------------------------------------------------------------------------------------

    def _where(self) -> str:
        return f"{self.source}:{self._line_no}"

    def _seen(self, fmt: str) -> None:
        self.formats[fmt] = self.formats.get(fmt, 0) + 1

    def _event(self, kind: str, line: str, *, step: int | None = None, value: float | None = None,
               rank: int | None = None, count: int | None = None) -> None:
        wall, host = system.parse_time(line, self.year)
        self.events.append(LogEvent(kind=kind, message=line.strip()[:300], source=self._where(),
                                    step=step if step is not None else self._current_step(), wall_time=wall,
                                    rank=rank, host=host or self.host, value=value, count=count))

    @property
    def step(self) -> int | None:
        """The training step the log is at (the last record's, or the last progress-bar counter)."""
        return self._current_step()

    def _current_step(self) -> int | None:
        if self._tqdm_step is not None:
            return self._tqdm_step
        return self._last_step

    def _banner(self, context: dict[str, str]) -> None:
        self.builder.banner(context)
        for key, value in context.items():
            self.context.setdefault(key, value)
        self._streak = 0

    def _record(self, step: int, signals: dict[str, float], line: str) -> None:
        self._last_overflow = None
        if self._pending_skips:
            signals["skipped"] = max(signals.get("skipped", 0.0), float(self._pending_skips))
            if self._pending_scale is not None and "loss_scale" not in signals:
                signals["loss_scale"] = self._pending_scale
            self._pending_skips, self._pending_scale = 0, None
        elif signals.get("skipped", 0.0) <= 0:
            self._streak = 0
        if signals.get("loss_scale") == 0.0:  # printed rounded to 0 decimals (fairseq): not a real scale
            del signals["loss_scale"]
        wall, _ = system.parse_time(line, self.year)
        self.builder.add(StepRecord(run_id=self.run_id, step=step, rank=self.rank, signals=signals,
                                    wall_time=wall or 0.0, host=self.host))
        self._last_step = step

    # -- formats -------------------------------------------------------------------------------------------------

    def _megatron(self, line: str, stripped: str) -> bool:
        if _ARGS_START.match(stripped):
            self._in_args, self._args = True, {}
            self._seen("megatron")
            return True
        match = _ITERATION.search(line)
        if match:
            signals: dict[str, float] = {}
            body = match.group(3)
            layout = self._layout
            fields = layout[0].fullmatch(body) if layout is not None else None
            if layout is None or fields is None:  # a new line layout (or the first): its pattern, then its fields
                layout = self._layout = _layout(body)
                fields = layout[0].fullmatch(body)
            for name, value in zip(layout[1], fields.groups() if fields else (), strict=True):
                number = _number(value)
                if number is not None:
                    signals[name] = number
            if not signals:
                return False
            self._seen("megatron")
            self._record(int(match.group(1)), signals, line)
            return True
        if "using world size" in line:
            world = _WORLD.search(line)
            if world:
                context = {"world_size": world.group(1)}
                context.update({signal_name(k): v for k, v in _SIZES.findall(world.group(2))})
                self._banner(context)
                self._seen("megatron")
                return True
        if "checkpoint" in line and "iteration" in line:
            ckpt = _CKPT.search(line)
            if ckpt:
                self._event("checkpoint_load", line, value=float(ckpt.group(1) or ckpt.group(2)))
                return True
        return False

    def _arg_line(self, stripped: str) -> None:
        if _ARGS_END.match(stripped):
            self._in_args = False
            keep = {k: v for k, v in self._args.items() if k in _CONTEXT_ARGS}
            self._banner(keep or {"arguments": str(len(self._args))})
            return
        match = _ARG_LINE.match(stripped)
        if match:
            self._args[match.group(1)] = match.group(2)

    def _deepspeed(self, line: str, stripped: str) -> bool:
        if "Attempted loss scale" in line:
            match = _OVERFLOW.search(line)
            if match:
                self._seen("deepspeed")
                # with hysteresis left DeepSpeed skips the step but keeps the scale
                self._overflow(line, float(match.group(2) or match.group(1)), _rank_of(_DS_RANK.search(line)))
                return True
        if "step=" in line and "skipped=" in line:
            match = _DS_STEP.search(line)
            if match:
                self._seen("deepspeed")
                step, total = int(match.group(1)), int(match.group(2))
                signals: dict[str, float] = {}
                lr = _number(match.group(3).split(",")[0])
                if lr is not None:
                    signals["lr"] = lr
                before = self._ds_skipped.get(0)
                if before is not None and total >= before:
                    signals["skipped"] = float(total - before)
                self._ds_skipped[0] = total
                self._record(step, signals, line)
                return True
        if _MINIMUM.search(line):
            self._seen("deepspeed" if "fairseq" not in line else "fairseq")
            self._event("scale_minimum", line)
            return True
        if "DeepSpeed info" in line:
            match = _DS_VERSION.search(line)
            if match:
                self._seen("deepspeed")
                self._banner({"deepspeed": match.group(1)})
                return True
        return False

    def _overflow(self, line: str, scale: float, rank: int | None) -> None:
        # every data-parallel rank prints the same overflow ("OVERFLOW! Rank 3 ..."): one overflow, not eight
        same = self._last_overflow
        if rank is not None and same is not None and same[0] == scale and rank not in same[1]:
            same[1].add(rank)
            return
        self._last_overflow = (scale, {rank} if rank is not None else set())
        self._streak += 1
        self._pending_skips += 1
        self._pending_scale = scale
        step = self._tqdm_step + 1 if self._tqdm_step is not None else None
        self._event("overflow", line, step=step, value=scale, rank=rank, count=self._streak)

    def _hf(self, line: str, stripped: str) -> bool:
        if _BANNER_HF in line:
            self._seen("hf-trainer")
            self._banner({"trainer": "transformers"})
            return True
        if "{'" not in line:
            return False
        match = _DICT.search(line)
        if not match:
            return False
        signals: dict[str, float] = {}
        for key, value in _DICT_PAIR.findall(match.group(0)):
            number = _number(value)
            if number is not None:
                signals[signal_name(key)] = number
        if not ({"loss", "val_loss", "grad_norm"} & set(signals)):
            return False
        self._seen("hf-trainer")
        step_value = signals.pop("step", None)
        if step_value is not None and step_value.is_integer():
            step = int(step_value)
        elif self._tqdm_step is not None:
            step = self._tqdm_step
        else:
            self._ordinal += 1
            step = self._ordinal
            if not self._ordinal_noted:
                self.notes.append(f"{self.source}: the HF Trainer prints carry no step; steps are their ordinals")
                self._ordinal_noted = True
        self._record(step, signals, line)
        return True

    def _fairseq(self, line: str, stripped: str) -> bool:
        if "overflow detected" in line:
            match = _FAIRSEQ_OVERFLOW.search(line)
            if match:
                self._seen("fairseq")
                self._overflow(line, float(match.group(1)), None)
                return True
        match = _FAIRSEQ_INNER.search(line)
        pairs: list[tuple[str, str]] = []
        if match:
            pairs = [tuple(p.strip().split("=", 1)) for p in match.group(4).split(",") if "=" in p]  # type: ignore[misc]
        elif "| epoch" in line and "num_updates" in line:
            summary = _FAIRSEQ_SUMMARY.search(line)
            if summary:
                cells = [c.strip().split(None, 1) for c in summary.group(1).split("|")]
                pairs = [(c[0], c[1]) for c in cells if len(c) == 2]
        if not pairs:
            return False
        valid = "valid on" in line
        signals: dict[str, float] = {}
        step: int | None = None
        for key, value in pairs:
            number = _number(value)
            if number is None:
                continue
            if key == "num_updates":
                step = int(number)
                continue
            name = signal_name(key)
            if valid and not name.startswith("val"):
                name = f"val_{name}"
            signals[name] = number
        if step is None or not signals:
            return False
        self._seen("fairseq")
        self._record(step, signals, line)
        return True

    def _nanogpt(self, line: str, stripped: str) -> bool:
        match = _NANOGPT.match(stripped)
        if match:
            signals = {"loss": _number(match.group(2))}
            if match.group(3):
                signals["iter_time_ms"] = _number(match.group(3))
            clean = {k: v for k, v in signals.items() if v is not None}
            if clean:
                self._seen("nanogpt")
                self._record(int(match.group(1)), clean, line)
                return True
        match = _LLMC.match(stripped)
        if match and (":" in match.group(2)):
            signals2: dict[str, float] = {}
            for key, value in _KV_COLON.findall(match.group(2)):
                number = _number(value)
                if number is not None:
                    signals2[signal_name(key)] = number
            if {"loss", "val_loss"} & set(signals2):
                self._seen("nanogpt")
                self._record(int(match.group(1)), signals2, line)
                return True
        return False

    def _other(self, line: str) -> None:
        found = system.classify(line)
        if found is not None:
            kind, value, rank = found
            self._seen("system")
            self._event(kind, line, value=value, rank=rank)
            if kind == "xid" and value is not None and int(value) in system.ECC_XIDS:
                self._event("ecc", line, value=value)
            return
        if _CRASH.search(line):
            self._event("crash", line)
            return
        if "version" in line.lower():
            versions = {k.lower(): v for k, v in _VERSIONS.findall(line)}
            if versions:
                self.builder.add_context(versions)
                for key, value in versions.items():
                    self.context.setdefault(key, value)


_CONTEXT_ARGS = frozenset({
    "world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
    "context_parallel_size", "expert_model_parallel_size", "micro_batch_size", "global_batch_size",
    "rampup_batch_size", "lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "lr_warmup_samples",
    "lr_decay_iters", "lr_decay_samples", "train_iters", "train_samples", "fp16", "bf16", "params_dtype",
    "loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis", "clip_grad",
    "adam_beta1", "adam_beta2", "adam_eps", "weight_decay", "seed", "log_interval", "load", "save",
    "seq_length", "num_layers", "hidden_size", "num_attention_heads", "data_path", "tokenizer_type",
    "deepspeed", "zero_stage", "iteration", "consumed_train_samples", "override_opt_param_scheduler",
    "use_checkpoint_opt_param_scheduler", "finetune", "no_load_optim", "no_load_rng",
})
"""Megatron arguments kept as run context (parallel sizes, LR schedule, precision, resume options)."""


def _layout(body: str) -> tuple[re.Pattern[str], tuple[str, ...]]:
    """A pattern matching Megatron iteration lines whose ``|``-separated fields have the keys of ``body`` in its order
    (one value group a ``key: value`` field; a field without ``:`` any text without one), and the fields' signal
    names: every line of a log prints the same fields, so a line is read by one match instead of a split per
    field. A line the pattern matches splits into the same fields (the key is the text before the field's first
    ``:``)."""
    parts, names = [], []
    for part in body.split("|"):
        key, sep, _ = part.partition(":")
        if sep:
            parts.append(re.escape(key) + ":([^|]*)")
            names.append(signal_name(key))
        else:
            parts.append("[^|:]*")
    return re.compile(r"\|".join(parts), re.DOTALL), tuple(names)


def _rank_of(match: re.Match[str] | None) -> int | None:
    return int(match.group(1)) if match else None


def sniff_lines(lines: Iterator[str], limit: int = 2000) -> dict[str, int]:
    """Count the formats of up to ``limit`` lines."""
    counts: dict[str, int] = {}
    for i, line in enumerate(lines):
        if i >= limit:
            break
        if line.startswith("# "):
            continue
        fmt = line_format(line)
        if fmt is not None:
            counts[fmt] = counts.get(fmt, 0) + 1
    return counts

