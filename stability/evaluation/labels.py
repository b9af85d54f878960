"""Corpus (b): the real logs in ``shared/data/real-runs`` with the labels used for scoring, and their sources.

Clean baselines (KellerJordan/modded-nanogpt, ``mng_*.csv``) have no labelled instability: every warning/error
on them is a false alarm. Their one-step batch-content jumps (README section A: 36 values > 1.5x in the 1.5B run,
the same steps 918/919/946/947 jumping in four runs) must not be alerted on; an INFO ``bad_batch`` is fine.

Labelled excerpts (bigscience chronicles, issue-thread snippets) are short (2-11 rows, some logged every 10
iterations), so they measure recall and delay only; false alarms are not counted on them. Each label quotes the
source text that justifies it (from ``real-runs/README.md`` and shared reference ``root-causes.md``). Onsets
follow the same rule as the synthetic corpus: the first row whose loss is >= 1.5x the last pre-event row, or
non-finite; ``precursor_start`` is the first row where the source says a precursor (grad norm, loss scale) moved.
Causes are given only where the source states one; otherwise ``cause=None`` (not scored for AC@k).

Logging regimes: the clean baselines are logged every step; the bigscience excerpts are Megatron log lines, some
every 10 iterations, whose ``lm loss`` is the *mean* over the log interval (``loss_steps``, set by
:func:`~stability.postmortem.load_csv` from the Megatron fields). So that rules written for coarse logs are held
to the same false-alarm standard, each clean baseline is also scored in two coarse views (:func:`coarse_views`):
10-step means (``@mean10``, as Megatron / the HF Trainer would log it) and every 10th step (``@every10``, as
nanoGPT's ``log_interval`` samples it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from stability.evaluation.corpus import Event, GeneratedRun
from stability.postmortem import load_csv, load_csv_groups
from stability.records import StepRecord

__all__ = ["CLEAN_BASELINES", "EXCERPTS", "Excerpt", "coarse_views", "default_data_dir", "load_real", "real_split"]

CLEAN_BASELINES: tuple[str, ...] = (
    "mng_llmc_gpt2_124M_2024-10-13.csv",
    "mng_adamw_baseline_2024-06-06.csv",
    "mng_muon_2024-10-10.csv",
    "mng_scaleup1p5B_2024-10-20_87bd51fd.csv",
    "mng_shortcutstweaks_2024-11-06_042f9e87.csv",
    "mng_valueembed_2024-12-04_00008ea0.csv",
    "mng_valueembed_2024-12-04_123ac41a.csv",
)
"""Long clean runs (README section A: "No instability is labelled by the source")."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Excerpt:
    """A labelled excerpt: one CSV file (or one group of it) and its events."""

    file: str
    events: tuple[Event, ...]
    source: str
    """The text that justifies the labels."""
    group_column: str | None = None
    group: str = ""
    step_column: str = "step"
    rename: Mapping[str, str] = field(default_factory=dict)


def _ev(kind: str, onset: int, end: int, precursor: int | None = None, cause: str | None = None,
        note: str = "") -> Event:
    return Event(kind=kind, cause=cause, onset=onset, end=end,
                 precursor_start=onset if precursor is None else precursor, note=note)


_BS8 = "bigscience_tr8-104B_spike_excerpts.csv"
EXCERPTS: tuple[Excerpt, ...] = (
    Excerpt(file="bigscience_tr1-13B_spike_excerpt.csv", group_column="episode", group="huge_lm_loss_spike_29050",
            events=(_ev("loss_spike", 29050, 29090, note="logged every 10 iterations"),),
            source='tr1-13B chronicles "A huge lm loss spike": loss "jumped from ~3 to ~9" at 29050 (2.768131 -> '
                   '7.343709 -> 8.715872 at 29060); "took some 500 iterations to recover".'),
    Excerpt(file=_BS8, group_column="episode", group="exp1_seed42_glitch_7000-7010",
            events=(_ev("loss_spike", 7010, 7220, note="rows 7000, 7010, 7220 only"),),
            source="tr8-104B exp1: lm loss 6.4 -> 14 between 7000 and 7010 (the quoted 7010 line shows 11.42), "
                   "stayed ~7, later NaN -> rolled back."),
    Excerpt(file=_BS8, group_column="episode", group="exp2_seed43_glitch_6900-6940",
            events=(_ev("divergence", 6940, 6940, precursor=6910, cause="warmup_too_short",
                        note="every 10 iterations; 10.24 at 6940 is the first row >= 1.5x 6.37"),),
            source='tr8-104B exp2: 6.3 -> 9 -> ... "near the end of LR warm-up"; root-causes.md #8: two glitches '
                   '"happened very closely to the moment where LR warmup stopped".'),
    Excerpt(file=_BS8, group_column="episode", group="exp11_spike_11447",
            events=(_ev("loss_spike", 11448, 11448, precursor=11447),),
            source='tr8-104B exp11: "huge spike", 3.11 -> 7.71, grad norm 262623 one step before (root-causes.md '
                   "lead table: 1 step)."),
    Excerpt(file=_BS8, group_column="episode", group="exp12_spike_8740_then_diverged_9026",
            events=(_ev("loss_spike", 8741, 8743, precursor=8740),
                    _ev("divergence", 9026, 9027, note="9026-9027 only")),
            source='tr8-104B exp12: spike 8740-8743 (grad norm up to 3,273,877), then "training diverged" at '
                   "9026-9027."),
    Excerpt(file="bigscience_tr8b-104B_spike_excerpt.csv", group_column="episode",
            group="emb-norm_exp07_optimizer-reset_spike_17062_then_NaN",
            events=(_ev("loss_spike", 17062, 17068),
                    _ev("loss_scale_collapse", 17063, 17068, cause="fp16_loss_scale")),
            source='tr8b-104B Emb-Norm Exp 7: spike "only 2.7 to 4.4" at 17062; consecutive "OVERFLOW! Skipping '
                   'step" halved the loss scale 1,048,576 -> 32,768 (root-causes.md #9, fp16 loss-scale collapse).'),
    Excerpt(file="bigscience_tr11-176B-BLOOM_spike_excerpt.csv", group_column="episode",
            group="first_lm_loss_spike_31216-31250",
            events=(_ev("loss_spike", 31219, 31222, precursor=31215),),
            source='tr11-176B "First lm loss spike": grad norm 0.242 -> 960.351 at 31219, loss 2.198845 -> '
                   '5.098124; grad norm off baseline at 31215; "recovered in ~30 iterations".'),
    Excerpt(file="snippets/chinese_transformer_xl_issue7_fp16_overflow_nan.csv",
            events=(_ev("nan", 700, 700, precursor=500, cause="fp16_loss_scale"),),
            source="THUDM/Chinese-Transformer-XL#7 (fp16 overflow): loss scale 64 -> 8 -> 4, lm loss NAN at 700, "
                   "training continues."),
    Excerpt(file="snippets/ipex_llm_issue1486_bigdl_inf_loss.csv",
            events=(_ev("nan", 45459, 45459),),
            source="intel/ipex-llm#1486: single Infinity loss at 45459 (maintainer: 'loss became infinity')."),
    Excerpt(file="snippets/nanogpt_issue215_fp16_nan_onset.csv",
            events=(_ev("nan", 3010, 3070),),
            source='karpathy/nanoGPT#215 "train loss become nan since iter 3000": nan from 3010.'),
    Excerpt(file="snippets/unsloth_issue5207_gemma4_31b_lora_gradnorm_spikes.csv", step_column="log_index",
            events=(_ev("grad_explosion", 4, 4), _ev("grad_explosion", 9, 9)),
            source="unslothai/unsloth#5207: poster-labelled grad-norm spikes 92.10 (index 4) and 11140.00 "
                   "(index 9) with normal loss."),
    Excerpt(file="snippets/litgpt_issue628_codellama7b_fullft_spike.csv", group_column="segment",
            group="bf16-default", step_column="micro_iter",
            events=(_ev("loss_spike", 1152, 1159, note="per micro-iteration"),),
            source='Lightning-AI/litgpt#628: "starting from certain iteration, the loss spikes" — micro-iter '
                   "1152: 1.7019 -> 11.4630, then 10.0-12.2 through 1159."),
)
"""Labelled excerpts. Left out: mlx-examples#620 (the poster does not call it a spike: unlabelled) and the
``other-precision`` segment of litgpt#628 (an oscillation the source does not label)."""


def default_data_dir() -> Path:
    """``$STABILITY_REAL_RUNS``, else ``shared/data/real-runs`` next to the repository checkout."""
    env = os.environ.get("STABILITY_REAL_RUNS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data" / "real-runs"


def real_split(split: str) -> tuple[tuple[str, ...], tuple[Excerpt, ...]]:
    """The clean baselines and excerpts of one split of the families corpus (``calib``, ``test`` or ``all``).

    Deterministic and independent of the data: the clean files sorted by name and the excerpts in
    :data:`EXCERPTS` order are dealt alternately, the first to ``test`` (so the test side gets the odd one):
    test = clean files 0, 2, 4, 6 and excerpts 0, 2, 4, ...; calibration = the others.
    """
    if split == "all":
        return CLEAN_BASELINES, EXCERPTS
    if split not in ("calib", "test"):
        raise ValueError(f"unknown split {split!r}")
    parity = 0 if split == "test" else 1
    clean = tuple(n for i, n in enumerate(sorted(CLEAN_BASELINES)) if i % 2 == parity)
    return clean, tuple(ex for i, ex in enumerate(EXCERPTS) if i % 2 == parity)


def load_real(data_dir: Path | None = None, *, clean: bool = True, excerpts: bool = True,
              split: str = "all") -> list[GeneratedRun]:
    """The real corpus as runs (clean baselines with ``clean=True``, excerpts with their events); ``split``
    ``calib`` / ``test`` keeps one side of :func:`real_split`."""
    root = data_dir or default_data_dir()
    clean_files, chosen = real_split(split)
    runs = []
    if clean:
        for name in clean_files:
            path = root / name
            if path.exists():
                records = load_csv(path)
                runs.append(GeneratedRun(name=path.stem, records=records, clean=True, source="real-clean"))
                runs.extend(GeneratedRun(name=f"{path.stem}@{view}", records=recs, clean=True, source="real-clean")
                            for view, recs in coarse_views(records).items())
    if excerpts:
        for ex in chosen:
            path = root / ex.file
            if not path.exists():
                continue
            groups = load_csv_groups(path, ex.group_column, step_column=ex.step_column, rename=dict(ex.rename))
            records = groups.get(ex.group, [])
            name = f"{path.stem}:{ex.group}" if ex.group else path.stem
            runs.append(GeneratedRun(name=name, records=records, events=list(ex.events), source="real-excerpt"))
    return runs


def coarse_views(records: Sequence[StepRecord], every: int = 10) -> dict[str, list[StepRecord]]:
    """``{"mean<every>": ..., "every<every>": ...}``: the per-step loss logged coarsely (one rank).

    ``mean``: one record per ``every`` consecutive loss records, at the last one's step, with the mean loss and
    ``loss_steps = every``; ``every``: each ``every``-th loss record as it is.
    """
    losses = [r for r in records if math.isfinite(r.get("loss"))]
    means = [
        StepRecord(run_id=chunk[-1].run_id, step=chunk[-1].step, rank=chunk[-1].rank,
                   signals={"loss": sum(r.get("loss") for r in chunk) / every, "loss_steps": float(every)})
        for chunk in (losses[i : i + every] for i in range(0, len(losses) - every + 1, every))
    ]
    return {f"mean{every}": means, f"every{every}": losses[every - 1 :: every]}
