"""AutoTP: tensor parallelism for Hugging Face models, inferred from the model.

Turned on by the ``tensor_parallel`` config section of :func:`polyaccel.initialize` (see
:mod:`.config`), or applied directly with :func:`apply_tensor_parallel` on a
:class:`~polyaccel.comm.mesh.ParallelMesh`. :func:`infer_plan` shows what would be split without
touching the model (``polyaccel autotp-plan`` prints it).
"""

from .apply import TPState, apply_tensor_parallel, get_plan, sum_partial_grads
from .config import TPConfig, parse
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    gather_logits,
)
from .loss import vocab_parallel_cross_entropy
from .plan import TPPlan, infer_plan
from .shard import shard_sizes

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "TPConfig", "TPPlan", "TPState", "VocabParallelEmbedding",
    "VocabParallelLMHead", "apply_tensor_parallel", "gather_logits", "get_plan", "infer_plan", "parse",
    "shard_sizes", "sum_partial_grads", "vocab_parallel_cross_entropy",
]
