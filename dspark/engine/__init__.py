"""The continuous-batching engine: requests, the step loop, text streaming with stop strings."""
from dspark.engine.engine import Engine, EngineConfig, QueueFull, StepInfo
from dspark.engine.request import Request, RequestOutput, RoundStats

__all__ = ["Engine", "EngineConfig", "QueueFull", "Request", "RequestOutput", "RoundStats", "StepInfo"]
