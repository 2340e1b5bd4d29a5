"""Algorithm hooks: small strategy objects that turn a task's rollouts into its training group."""
from guijax.algorithms.base import Algorithm, GRPO, make_algorithm

__all__ = ["Algorithm", "GRPO", "make_algorithm"]
