"""Algorithm hooks: small strategy objects that turn a task's rollouts into its training group."""
from guijax.algorithms.base import GRPO, Algorithm, algorithm_names, make_algorithm

__all__ = ["Algorithm", "GRPO", "algorithm_names", "make_algorithm"]
