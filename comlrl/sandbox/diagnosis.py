"""Why bubblewrap could not start a sandbox here, and what fixes it: one clause each, for the refusal's one line.

Full isolation needs the kernel to let an unprivileged process create a user namespace (and, inside it, mount a
fresh ``/proc``). Each way a machine says no has its own remedy, so the refusal names the cause that the
machine's settings show (:class:`HostFacts`, read from ``/proc``) and the remedy for that cause.
:func:`explain` is a pure function of bubblewrap's last message and those facts.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

COMPOSE_OPTIONS = ("--security-opt seccomp=unconfined --security-opt apparmor=unconfined "
                   "--security-opt systempaths=unconfined")


@dataclass(frozen=True)
class HostFacts:
    """What this machine says about user namespaces (None: the setting does not exist here)."""

    max_user_namespaces: int | None = None  # user.max_user_namespaces in this process's namespace
    unprivileged_userns_clone: int | None = None  # Debian's and older Ubuntu's kernel.unprivileged_userns_clone
    apparmor_restricts_userns: int | None = None  # Ubuntu 23.10+: kernel.apparmor_restrict_unprivileged_userns
    container: str | None = None  # "docker", "podman", "kubernetes" or "a container"
    seccomp_filtered: bool = False  # a seccomp filter applies to this process (Seccomp: 2)
    slot_uid_unmapped: int | None = None  # a slot uid that this user namespace does not map (under root)
    system_bwrap: str | None = None  # bubblewrap installed by the distribution (/usr/bin/bwrap)


def explain(said: str, bwrap: str, facts: HostFacts) -> str | None:
    """The cause and its remedy in one clause, or None when the facts and the message name no known cause."""
    lowered = said.lower()
    if facts.slot_uid_unmapped is not None or "setresuid" in lowered or "setreuid" in lowered:
        uid = facts.slot_uid_unmapped
        return (f"the sandbox's slot uid{f' {uid}' if uid is not None else 's'} cannot be taken: this user namespace "
                "does not map uids 61000-61255 (a rootless or user-namespace-remapped container); map that range "
                "into it, or run the trainer as a non-root user (the sandbox then runs programs as that user)")
    if facts.max_user_namespaces == 0 or "max_" in lowered or "enospc" in lowered:
        return ("user namespaces are limited to 0 here (user.max_user_namespaces = "
                f"{facts.max_user_namespaces if facts.max_user_namespaces is not None else 'exhausted'}); raise the "
                "limit as root on the host: sysctl -w user.max_user_namespaces=15000")
    if facts.unprivileged_userns_clone == 0:
        return ("unprivileged user namespaces are switched off (kernel.unprivileged_userns_clone = 0); switch them "
                "on as root on the host: sysctl -w kernel.unprivileged_userns_clone=1")
    if facts.apparmor_restricts_userns == 1:
        system = (f"use the distribution's {facts.system_bwrap}, which its AppArmor profile allows (the sandbox "
                  "prefers it when it is 0.10 or later)" if facts.system_bwrap and facts.system_bwrap != bwrap else
                  "install the distribution's bubblewrap (apt-get install bubblewrap), whose /usr/bin/bwrap has an "
                  "AppArmor profile and is preferred by the sandbox")
        return (f"AppArmor restricts unprivileged user namespaces to programs with a profile "
                f"(kernel.apparmor_restrict_unprivileged_userns = 1) and {bwrap} has none; {system}, or lift the "
                "restriction as root: sysctl -w kernel.apparmor_restrict_unprivileged_userns=0")
    if facts.container is not None and "proc" in lowered:
        return (f"{facts.container} masks parts of /proc, so the sandbox cannot mount its own; start the container "
                "with --security-opt systempaths=unconfined (Kubernetes: securityContext.procMount: Unmasked), as "
                "infra/compose.yaml does")
    if facts.container is not None and ("permitted" in lowered or "namespace" in lowered or facts.seccomp_filtered):
        return (f"{facts.container}'s security profile forbids creating user namespaces or mounting in them "
                f"(seccomp{' filter active' if facts.seccomp_filtered else ''}, AppArmor); start the container with "
                f"{COMPOSE_OPTIONS} (Kubernetes: seccompProfile and appArmorProfile Unconfined, procMount Unmasked), "
                "as infra/compose.yaml does")
    if "permitted" in lowered or "namespace" in lowered:
        return ("creating a user namespace was refused by a security policy (seccomp, AppArmor or SELinux); allow "
                f"unprivileged user namespaces for {bwrap}, or run under a policy that does")
    return None


def read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as handle:
            return int(handle.read().strip())
    except (OSError, ValueError):
        return None


def container_kind() -> str | None:
    """Which container this process runs in, as far as the usual markers tell (None: none found)."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return "Kubernetes"
    if os.path.exists("/run/.containerenv"):
        return "Podman"
    if os.path.exists("/.dockerenv"):
        return "Docker"
    try:
        with open("/proc/1/cgroup", encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError:
        return None
    for marker, name in (("kubepods", "Kubernetes"), ("libpod", "Podman"), ("docker", "Docker"),
                         ("containerd", "a container")):
        if marker in text:
            return name
    return None


def seccomp_filtered() -> bool:
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as handle:
            return any(line.split() == ["Seccomp:", "2"] for line in handle)
    except OSError:
        return False


def maps_uid(uid: int, uid_map: str) -> bool:
    """Whether the ``/proc/self/uid_map`` text ``uid_map`` maps ``uid`` (inside the namespace)."""
    for line in uid_map.splitlines():
        fields = line.split()
        if len(fields) == 3 and all(field.isdigit() for field in fields):
            inside, _, count = map(int, fields)
            if inside <= uid < inside + count:
                return True
    return False


def host_facts(slot_uid: int | None) -> HostFacts:
    """This machine's facts, with ``slot_uid`` (a slot's uid under root, else None) checked against the uid map."""
    unmapped = None
    if slot_uid is not None:
        try:
            with open("/proc/self/uid_map", encoding="ascii") as handle:
                unmapped = None if maps_uid(slot_uid, handle.read()) else slot_uid
        except OSError:
            unmapped = None
    system = shutil.which("bwrap", path="/usr/bin:/bin")
    return HostFacts(max_user_namespaces=read_int("/proc/sys/user/max_user_namespaces"),
                     unprivileged_userns_clone=read_int("/proc/sys/kernel/unprivileged_userns_clone"),
                     apparmor_restricts_userns=read_int("/proc/sys/kernel/apparmor_restrict_unprivileged_userns"),
                     container=container_kind(), seccomp_filtered=seccomp_filtered(), slot_uid_unmapped=unmapped,
                     system_bwrap=system)
