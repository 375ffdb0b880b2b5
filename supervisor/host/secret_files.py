"""Secret files the operator hands the supervisor (a CURVE key file, the metrics token): whom they may be readable by.

One rule for every secret file, so a key file and a token file that sit side by side in one
Kubernetes Secret are judged alike.
"""

from __future__ import annotations

import stat

__all__ = ["key_file_mode_problem"]


def key_file_mode_problem(mode: int, owner: int, group: int, *, uid: int, gid: int) -> str | None:
    """Why a secret key file with this mode, owner and group must not be used by (``uid``, ``gid``); None: fine.

    Accepted: 0600/0400 (or stricter) owned by us, and - the mode a Kubernetes Secret has when the pod
    sets ``fsGroup`` (kubelet adds group read to ``defaultMode: 0400``) - 0440 owned by root or us in
    *our own* group (``gid``: the process's effective group, ``runAsGroup``). Never: any permission
    for others, group write or execute, or group read for any group but ours.
    """
    perms = stat.S_IMODE(mode)
    if perms & stat.S_IRWXO:
        return f"is readable by others (mode {oct(perms)}); chmod 600 it"
    if perms & stat.S_IRWXG:
        if perms & (stat.S_IWGRP | stat.S_IXGRP) or group != gid or owner not in (0, uid):
            return (f"is readable by its group {group} (mode {oct(perms)}, owner {owner}); chmod 600 it, or "
                    f"make it 0440, owned by root or uid {uid}, in this process's own group {gid} "
                    "(Kubernetes: runAsGroup = fsGroup)")
    elif owner != uid:
        return f"belongs to uid {owner}, not to this process's uid {uid}; chown it"
    return None
