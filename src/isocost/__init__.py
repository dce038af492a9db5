"""isocost: equal-cost load balancing, scheduling and capacity planning for LLM inference."""

__version__ = "0.1.0"
