"""The process kubelet's pure decisions (no cluster needed)."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from lora_devcluster import podlogic
from lora_devcluster.podlogic import ContainerConfigError, ContainerView

IMAGES = podlogic.parse_image_map(
    {
        "lora-operator/inference:*": ["/venv/bin/lora-inference"],
        "app:*": {"entrypoint": ["/bin/app"], "cmd": ["serve", "--default"]},
    }
)


@pytest.mark.parametrize(
    ("image", "command", "args", "expected"),
    [
        (
            "lora-operator/inference:dev",
            None,
            ["serve", "--port", "8000"],
            ["/venv/bin/lora-inference", "serve", "--port", "8000"],
        ),
        ("app:1", None, None, ["/bin/app", "serve", "--default"]),
        ("app:1", None, ["other"], ["/bin/app", "other"]),
        ("app:1", None, [], ["/bin/app"]),
        ("app:1", ["/bin/sh", "-c"], ["echo hi"], ["/bin/sh", "-c", "echo hi"]),
        ("unmapped:latest", ["python3", "-V"], None, ["python3", "-V"]),
    ],
    ids=[
        "mapped-args",
        "default-cmd",
        "args-replace-cmd",
        "empty-args",
        "command-wins",
        "unmapped-with-command",
    ],
)
def test_build_argv(
    image: str, command: list[str] | None, args: list[str] | None, expected: list[str]
) -> None:
    assert podlogic.build_argv(IMAGES, image, command, args) == expected


def test_unmapped_image_without_command_says_how_to_fix() -> None:
    with pytest.raises(ContainerConfigError, match="image map") as e:
        podlogic.build_argv(IMAGES, "nginx:1", None, None)
    assert e.value.reason == "ErrImageNeverPull"


def test_bad_image_map_entry_is_rejected() -> None:
    with pytest.raises(ValueError, match="expected a list"):
        podlogic.parse_image_map({"x": "not-a-list"})


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("$(A)-$(B)", "1-2"),
        ("$(MISSING)", "$(MISSING)"),
        ("$$(A)", "$(A)"),
        ("no refs", "no refs"),
    ],
    ids=["known", "unknown-kept", "escaped", "plain"],
)
def test_expand_vars(value: str, expected: str) -> None:
    assert podlogic.expand_vars(value, {"A": "1", "B": "2"}) == expected


def _ctx(**kw: Any) -> podlogic.PodContext:
    pod = {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"app": "x"}},
        "spec": {"nodeName": "n"},
    }
    return podlogic.PodContext(
        pod=pod,
        pod_ip="10.244.0.7",
        host_ip="10.244.0.1",
        configmaps=kw.get("configmaps", {"cm": {"k": "cv", "other": "o"}}),
        secrets=kw.get("secrets", {"s": {"token": b"sv"}}),
    )


def test_build_env_resolves_every_source_in_order() -> None:
    container = {
        "envFrom": [
            {"configMapRef": {"name": "cm"}, "prefix": "CM_"},
            {"secretRef": {"name": "s"}},
        ],
        "env": [
            {"name": "PLAIN", "value": "v"},
            {"name": "REF", "value": "$(PLAIN)/$(CM_k)"},
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "CMK", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
            {"name": "SK", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
            {
                "name": "OPT",
                "valueFrom": {"secretKeyRef": {"name": "nope", "key": "x", "optional": True}},
            },
        ],
    }
    env = podlogic.build_env(container, _ctx(), {"PATH": "/bin"})
    assert env == {
        "PATH": "/bin",
        "CM_k": "cv",
        "CM_other": "o",
        "token": "sv",
        "PLAIN": "v",
        "REF": "v/cv",
        "POD": "p",
        "NS": "ns",
        "IP": "10.244.0.7",
        "APP": "x",
        "CMK": "cv",
        "SK": "sv",
    }


@pytest.mark.parametrize(
    "var",
    [
        {"name": "X", "valueFrom": {"configMapKeyRef": {"name": "missing", "key": "k"}}},
        {"name": "X", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "missing"}}},
        {"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "spec.unknown"}}},
    ],
    ids=["missing-configmap", "missing-key", "unsupported-field"],
)
def test_build_env_errors_are_container_config_errors(var: dict[str, Any]) -> None:
    with pytest.raises(ContainerConfigError) as e:
        podlogic.build_env({"env": [var]}, _ctx(), {})
    assert e.value.reason == "CreateContainerConfigError"


def test_decode_secret_data() -> None:
    secret = {"data": {"a": base64.b64encode(b"\x00bin").decode()}, "stringData": {"b": "s"}}
    assert podlogic.decode_secret_data(secret) == {"a": b"\x00bin", "b": b"s"}


def test_projected_files_all_keys_or_items() -> None:
    data: dict[str, str | bytes] = {"a": "1", "b": b"2"}
    assert podlogic.build_projected_files(data, None, "cm") == {"a": b"1", "b": b"2"}
    items = [{"key": "b", "path": "sub/b.txt"}]
    assert podlogic.build_projected_files(data, items, "cm") == {"sub/b.txt": b"2"}
    with pytest.raises(ContainerConfigError):
        podlogic.build_projected_files(data, [{"key": "b", "path": "../escape"}], "cm")
    with pytest.raises(ContainerConfigError):
        podlogic.build_projected_files(data, [{"key": "zz", "path": "z"}], "cm")


def test_build_mounts() -> None:
    container = {
        "volumeMounts": [
            {"name": "data", "mountPath": "/data"},
            {"name": "cfg", "mountPath": "/etc/cfg"},
            {"name": "data", "mountPath": "/sub", "subPath": "x/y", "readOnly": True},
        ]
    }
    mounts = podlogic.build_mounts(container, {"data": "/v/data", "cfg": "/v/cfg"}, {"cfg"})
    assert mounts == [
        podlogic.Mount("/v/data", "/data", False),
        podlogic.Mount("/v/cfg", "/etc/cfg", True),
        podlogic.Mount("/v/data/x/y", "/sub", True),
    ]
    with pytest.raises(ContainerConfigError, match="names no volume"):
        podlogic.build_mounts({"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}, {}, set())


@pytest.mark.parametrize(
    ("policy", "code", "restart"),
    [
        ("Always", 0, True),
        ("Always", 1, True),
        ("OnFailure", 0, False),
        ("OnFailure", 137, True),
        ("Never", 1, False),
    ],
)
def test_should_restart(policy: str, code: int, restart: bool) -> None:
    assert podlogic.should_restart(policy, code) is restart


def test_restart_backoff_doubles_and_caps() -> None:
    delays = [podlogic.restart_backoff(n, base=1.0, cap=10.0) for n in range(7)]
    assert delays == [0.0, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_resolve_port() -> None:
    c = {"name": "c", "ports": [{"name": "http", "containerPort": 8080}]}
    assert podlogic.resolve_port(c, "http") == 8080
    assert podlogic.resolve_port(c, 9000) == 9000
    assert podlogic.resolve_port(c, "9001") == 9001
    with pytest.raises(ValueError, match="no port named"):
        podlogic.resolve_port(c, "grpc")


def _status(views: list[ContainerView], policy: str = "Always", old: Any = None) -> Any:
    pod = {"spec": {"restartPolicy": policy}, "status": old or {}}
    return podlogic.build_pod_status(
        pod, views, pod_ip="10.244.0.9", host_ip="10.244.0.1", start_time="T0", now="T1"
    )


def _cond(status: Any, ctype: str) -> Any:
    return next(c for c in status["conditions"] if c["type"] == ctype)


def test_pod_status_running_and_ready() -> None:
    s = _status([ContainerView("c", "img", running_since="T0", ready=True)])
    assert s["phase"] == "Running"
    assert s["podIP"] == "10.244.0.9" and s["podIPs"] == [{"ip": "10.244.0.9"}]
    assert _cond(s, "Ready")["status"] == "True"
    cs = s["containerStatuses"][0]
    assert cs["ready"] and cs["started"] and cs["state"] == {"running": {"startedAt": "T0"}}


def test_pod_status_keeps_the_qos_class_the_api_server_set() -> None:
    views = [ContainerView("c", "img", running_since="T0", ready=True)]
    assert _status(views, old={"qosClass": "Burstable"})["qosClass"] == "Burstable"
    assert _status(views)["qosClass"] == "BestEffort"


def test_pod_status_not_ready_until_every_container_is() -> None:
    s = _status(
        [
            ContainerView("a", "img", running_since="T0", ready=True),
            ContainerView("b", "img", running_since="T0", ready=False),
        ]
    )
    assert _cond(s, "Ready")["status"] == "False"
    assert _cond(s, "Ready")["reason"] == "ContainersNotReady"


def test_pod_status_keeps_transition_time_when_unchanged() -> None:
    first = _status([ContainerView("c", "img", running_since="T0", ready=True)])
    again = podlogic.build_pod_status(
        {"spec": {}, "status": first},
        [ContainerView("c", "img", running_since="T0", ready=True)],
        pod_ip="10.244.0.9",
        host_ip="10.244.0.1",
        start_time="T0",
        now="T5",
    )
    assert _cond(again, "Ready")["lastTransitionTime"] == "T1"
    assert not podlogic.status_differs(first, again)


def test_pod_status_crash_loop_shows_last_state() -> None:
    last = {"exitCode": 1, "reason": "Error", "startedAt": "T0", "finishedAt": "T1"}
    s = _status(
        [
            ContainerView(
                "c", "img", restart_count=1, waiting_reason="CrashLoopBackOff", last_terminated=last
            )
        ]
    )
    cs = s["containerStatuses"][0]
    assert s["phase"] == "Running"
    assert cs["restartCount"] == 1
    assert cs["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    assert cs["lastState"] == {"terminated": last}


@pytest.mark.parametrize(
    ("policy", "codes", "phase"),
    [
        ("Never", [0], "Succeeded"),
        ("Never", [0, 3], "Failed"),
        ("OnFailure", [0], "Succeeded"),
    ],
)
def test_pod_phase_when_all_terminated(policy: str, codes: list[int], phase: str) -> None:
    views = [
        ContainerView(f"c{i}", "img", terminated={"exitCode": c, "reason": "x"})
        for i, c in enumerate(codes)
    ]
    assert podlogic.build_pod_phase(policy, views) == phase


def test_pending_before_anything_runs() -> None:
    assert podlogic.build_pod_phase("Always", [ContainerView("c", "img")]) == "Pending"


def test_etc_hosts_resolves_the_pod_name_to_its_ip() -> None:
    hosts = podlogic.build_etc_hosts("web-0", "10.244.0.5")
    assert "10.244.0.5\tweb-0\n" in hosts
    assert "127.0.0.1\tlocalhost\n" in hosts


LOG = (
    "--- lora-devcluster: starting c (restart 0) ---\n"
    "first run 1\nfirst run 2\n"
    "--- lora-devcluster: liveness probe failed, killing c ---\n"
    "--- lora-devcluster: starting c (restart 1) ---\n"
    "second run 1\nsecond run 2\nsecond run 3\n"
)


@pytest.mark.parametrize(
    ("previous", "tail", "expected"),
    [
        (False, None, "second run 1\nsecond run 2\nsecond run 3\n"),
        (False, 1, "second run 3\n"),
        (False, 0, ""),
        (True, None, "first run 1\nfirst run 2\n"
                     "--- lora-devcluster: liveness probe failed, killing c ---\n"),
    ],
    ids=["current", "tail-1", "tail-0", "previous"],
)  # fmt: skip
def test_select_log(previous: bool, tail: int | None, expected: str) -> None:
    assert podlogic.select_log(LOG, previous=previous, tail_lines=tail) == expected


def test_select_log_previous_without_a_restart_is_none() -> None:
    first_only = "--- lora-devcluster: starting c (restart 0) ---\nhello\n"
    assert podlogic.select_log(first_only, previous=True, tail_lines=None) is None
    assert podlogic.select_log("", previous=False, tail_lines=None) == ""


def _init_status(inits: list[ContainerView], policy: str = "Always") -> Any:
    main = [ContainerView("app", "img", running_since="T0", ready=True)]
    pod = {"spec": {"restartPolicy": policy}, "status": {}}
    return podlogic.build_pod_status(
        pod, main, pod_ip="10.244.0.9", host_ip="10.244.0.1", start_time="T0", now="T1",
        init_containers=inits,
    )  # fmt: skip


def test_pod_is_pending_and_not_initialized_while_an_init_container_runs() -> None:
    s = _init_status([ContainerView("init", "img", running_since="T0")])
    assert s["phase"] == "Pending"
    assert _cond(s, "Initialized")["status"] == "False"
    assert _cond(s, "Initialized")["reason"] == "ContainersNotInitialized"
    assert _cond(s, "Ready")["status"] == "False"
    assert s["initContainerStatuses"][0]["state"] == {"running": {"startedAt": "T0"}}


def test_pod_runs_once_init_containers_exited_zero() -> None:
    done = {"exitCode": 0, "reason": "Completed", "startedAt": "T0", "finishedAt": "T1"}
    s = _init_status([ContainerView("init", "img", terminated=done)])
    assert s["phase"] == "Running"
    assert _cond(s, "Initialized")["status"] == "True"
    assert _cond(s, "Ready")["status"] == "True"


def test_failed_init_container_fails_the_pod_only_with_restart_policy_never() -> None:
    failed = {"exitCode": 2, "reason": "Error", "startedAt": "T0", "finishedAt": "T1"}
    assert (
        _init_status([ContainerView("i", "img", terminated=failed)], "Never")["phase"] == "Failed"
    )
    assert podlogic.init_restart_policy("Always") == "OnFailure"
    assert podlogic.init_restart_policy("OnFailure") == "OnFailure"
    assert podlogic.init_restart_policy("Never") == "Never"


def test_mounts_are_ordered_parents_first_and_stable_otherwise() -> None:
    m = podlogic.Mount
    mounts = [
        m("/h/conf", "/tmp/conf", True),
        m("/h/hosts", "/etc/hosts", True),
        m("/h/tmp", "/tmp/", False),
        m("/h/sa", "/var/run/secrets/kubernetes.io/serviceaccount", True),
        m("/h/data", "/data", False),
    ]
    assert [x.source for x in podlogic.order_mounts(mounts)] == [
        "/h/tmp",
        "/h/data",
        "/h/conf",
        "/h/hosts",
        "/h/sa",
    ]


def test_volumes_at_or_above_the_image_paths_hide_them() -> None:
    mounts = [podlogic.Mount("/host/a", "/tmp", False), podlogic.Mount("/host/b", "/data", True)]
    paths = ["/tmp/ci/.venv", "/tmp", "/usr/lib/python3", "/datastore"]
    assert podlogic.hidden_by_mounts(mounts, paths) == ["/tmp/ci/.venv", "/tmp"]
