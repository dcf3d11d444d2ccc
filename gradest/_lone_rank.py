"""One warning per process when the launcher asked for several processes but no process
group exists: each process would then train alone on its own share, silently.

``torchrun`` / ``accelerate launch`` set ``WORLD_SIZE``; the ranks only average their
gradients once a ``torch.distributed`` process group is initialised (by
``init_process_group`` or by ``accelerate.Accelerator``). A common way to miss it:
``accelerate launch --multi_gpu`` with CPU processes and ``Accelerator()`` without
``cpu=True``, which then runs each process as a lone single-device job.
"""

from __future__ import annotations

import os
import warnings

import torch.distributed as dist

_warned = False


def warn_if_lone_rank() -> None:
    """Warn once per process (``RuntimeWarning``) when ``WORLD_SIZE > 1`` and no process
    group is initialised. Costs an environment lookup per call."""
    global _warned
    if _warned:
        return
    text = os.environ.get("WORLD_SIZE", "").strip()
    if not text:
        return
    try:
        world = int(text)
    except ValueError:
        return
    if world <= 1 or (dist.is_available() and dist.is_initialized()):
        return
    _warned = True
    rank = os.environ.get("RANK", "?")
    warnings.warn(
        f"WORLD_SIZE={world} but no torch.distributed process group is initialised, so this "
        f"process (RANK={rank}) trains alone and no gradients are averaged; call "
        f"torch.distributed.init_process_group(...) or create accelerate's "
        f"Accelerator(cpu=True) on CPUs before training (accelerate launch --multi_gpu with "
        f"CPU processes needs Accelerator(cpu=True))",
        RuntimeWarning,
        stacklevel=4,  # past estimate()/surrogate() and their keyword wrapper
    )
