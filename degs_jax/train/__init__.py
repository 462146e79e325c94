"""Training in JAX with optax: GRPO with verifiable rewards (`grpo`) and a tuned lens
(`tuned_lens`). Checkpoints are Hugging Face directories that `degs_jax.models.load`
reads back."""

from .data import Task, gsm8k_train_tasks, step_tasks
from .grpo import (GRPOConfig, group_advantages, grpo_token_loss, make_optimizer, rollout,
                   token_logprobs, train_grpo, update_step)
from .rewards import ContainsTokenReward, MathReward

__all__ = ["Task", "gsm8k_train_tasks", "step_tasks", "GRPOConfig", "group_advantages",
           "grpo_token_loss", "make_optimizer", "rollout", "token_logprobs", "train_grpo",
           "update_step", "ContainsTokenReward", "MathReward"]
