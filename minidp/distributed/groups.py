"""A process group's rank, size and backend, asked of the group itself.

``torch.distributed``'s functions of a group (``get_rank(group)``, ``get_world_size(group)``, ``get_backend(group)``,
``get_global_rank``) look it up in the world's map of groups, which holds those ``init_process_group`` and
``new_group`` made. A ``ProcessGroup`` built in Python (``class MyGroup(dist.ProcessGroup)``, as fault-tolerant
trainers build theirs, and torch's own ``test_c10d_pypg.py``) is not there; torch's DDP takes one, asking the group
(its C++ reducer calls ``process_group->getRank()``), and so does minidp's. The collectives take it as it is, with a
source or destination given by its rank in the group (``group_src=``).
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist


def rank_in(group: Optional[dist.ProcessGroup]) -> int:
    """This process's rank in ``group`` (``None``: the default group)."""
    return dist.get_rank() if group is None else group.rank()


def size_of(group: Optional[dist.ProcessGroup]) -> int:
    """The number of processes in ``group`` (``None``: the default group)."""
    return dist.get_world_size() if group is None else group.size()


def backend_of(group: Optional[dist.ProcessGroup]) -> str:
    """``group``'s backend, by name: ``"gloo"``, ``"nccl"``, or what a Python group's ``getBackendName`` says."""
    return dist.get_backend() if group is None else group.name()
