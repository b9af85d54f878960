"""Detectors, root-cause ranking and the RunDiagnoser (worker side; imports numpy only, no sklearn/statsmodels)."""

from stability.detectors.base import KINDS, CauseHint, Detector, Finding, Severity
from stability.detectors.causes import CATALOGUE
from stability.detectors.crossrank import CrossRankConfig, CrossRankDetector
from stability.detectors.divergence import DivergenceConfig, DivergenceDetector
from stability.detectors.engine import DiagnoserConfig, Incident, RunDiagnoser
from stability.detectors.fp16 import LossScaleConfig, LossScaleDetector
from stability.detectors.grad import GradConfig, GradExplosionDetector
from stability.detectors.growth import GrowthConfig, GrowthDetector
from stability.detectors.nan import NanConfig, NanDetector
from stability.detectors.plateau import PlateauConfig, PlateauDetector
from stability.detectors.ranking import Ranking, rank_causes
from stability.detectors.spike import SpikeConfig, SpikeDetector
from stability.detectors.update import AdamLagConfig, AdamLagDetector, LayerJumpConfig, LayerJumpDetector
from stability.detectors.vanish import GradVanishingDetector, VanishConfig

__all__ = [
    "AdamLagConfig",
    "AdamLagDetector",
    "CATALOGUE",
    "KINDS",
    "CauseHint",
    "CrossRankConfig",
    "CrossRankDetector",
    "Detector",
    "DiagnoserConfig",
    "DivergenceConfig",
    "DivergenceDetector",
    "Finding",
    "GradConfig",
    "GradExplosionDetector",
    "GradVanishingDetector",
    "GrowthConfig",
    "GrowthDetector",
    "Incident",
    "LayerJumpConfig",
    "LayerJumpDetector",
    "LossScaleConfig",
    "LossScaleDetector",
    "NanConfig",
    "NanDetector",
    "PlateauConfig",
    "PlateauDetector",
    "Ranking",
    "RunDiagnoser",
    "Severity",
    "SpikeConfig",
    "SpikeDetector",
    "VanishConfig",
    "rank_causes",
]
