"""The shadow predictor (installed as `od_moe.predictor`): a small MLX network that names the experts
the next MoE layers of a model will route to, trained on the model's own routing traces."""

from .model import PredictorConfig, ShadowPredictor, load_predictor

__all__ = ["PredictorConfig", "ShadowPredictor", "load_predictor"]
