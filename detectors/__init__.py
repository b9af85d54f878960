"""Detectors, root-cause ranking and the RunDiagnoser (worker side; imports numpy only, no sklearn/statsmodels)."""

from stability.detectors.base import KINDS, CauseHint, Detector, Finding, Severity
from stability.detectors.causes import CATALOGUE
from stability.detectors.divergence import DivergenceConfig, DivergenceDetector
from stability.detectors.engine import DiagnoserConfig, Incident, RunDiagnoser
from stability.detectors.grad import GradConfig, GradExplosionDetector
from stability.detectors.nan import NanConfig, NanDetector
from stability.detectors.ranking import Ranking, rank_causes
from stability.detectors.spike import SpikeConfig, SpikeDetector

__all__ = [
    "CATALOGUE",
    "KINDS",
    "CauseHint",
    "Detector",
    "DiagnoserConfig",
    "DivergenceConfig",
    "DivergenceDetector",
    "Finding",
    "GradConfig",
    "GradExplosionDetector",
    "Incident",
    "NanConfig",
    "NanDetector",
    "Ranking",
    "RunDiagnoser",
    "Severity",
    "SpikeConfig",
    "SpikeDetector",
    "rank_causes",
]
