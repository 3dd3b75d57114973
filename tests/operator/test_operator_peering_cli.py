"""Peering (one acting operator replica), the CLI's module list and argument rules, operator metrics."""
from __future__ import annotations

import asyncio
import importlib.util

import kmock
import pytest
from kopf.testing import KopfRunner

from kmock_support import fast_settings, wait_for
from kvfleet_operator import api as isvc_api
from kvfleet_operator import cli, peering

PEERINGS = "kopf.dev/v1/clusterkopfpeerings"


def test_newer_operator_has_higher_priority():
    old, new = peering.start_priority(1_700_000_000.0), peering.start_priority(1_700_000_000.5)
    assert new > old  # a rolling update's new pod takes over, the old one pauses (no tie, no freeze)


def test_module_list_includes_the_autoscaler_when_installed():
    mods = cli.operator_modules()
    assert mods[0] == "kvfleet_operator.handlers"
    assert ("kvfleet_operator.autoscaler" in mods) == (importlib.util.find_spec("kvfleet_operator.autoscaler") is not None)


def test_run_refuses_namespace_with_all_namespaces(capsys):
    assert cli.main(["run", "--namespace", "a", "--all-namespaces"]) == 2
    assert "exclude each other" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["run", "--peering", "x", "--standalone"])


async def test_peering_object_created_and_kept_alive(api, emulator):
    emulator.resources[PEERINGS] = kmock.ResourceInfo(kind="ClusterKopfPeering", singular="clusterkopfpeering",
                                                      namespaced=False, verbs={"list", "watch", "get", "patch",
                                                                               "create"})
    runner = KopfRunner(["run", "-A", "--peering", "kvfleet", "--priority", "7", "-m", "kvfleet_operator.handlers"],
                        timeout=30, settings=fast_settings())
    await asyncio.to_thread(runner.__enter__)
    try:
        async def alive():
            obj = await api.get("kopf.dev/v1", "clusterkopfpeerings", None, "kvfleet")
            peers = (obj or {}).get("status") or {}
            return peers if any(p.get("priority") == 7 for p in peers.values() if p) else None
        await wait_for(alive)
        # the only peer is not paused: it reconciles
        obj = {"apiVersion": isvc_api.API_VERSION, "kind": isvc_api.KIND,
               "metadata": {"name": "p", "namespace": "default"}, "spec": {"model": {"uri": "bundled://smollm2"},
                                                                         "resources": {"gpus": 0}}}
        await api.create(isvc_api.API_VERSION, isvc_api.PLURAL, "default", obj)
        await wait_for(lambda: api.get("apps/v1", "deployments", "default", "p"))
    finally:
        await asyncio.to_thread(runner.__exit__, None, None, None)


def test_operator_metrics_served_on_metrics(unused_tcp_port):
    import urllib.request

    from kvfleet_operator import metrics

    metrics.RECONCILES.labels(result="success").inc(0)
    metrics.ERRORS.labels(reason="Conflict").inc(0)
    metrics.CHILD_WRITES.labels(kind="deployment", action="create").inc(0)
    metrics.serve(unused_tcp_port, addr="127.0.0.1")
    text = urllib.request.urlopen(f"http://127.0.0.1:{unused_tcp_port}/metrics", timeout=5).read().decode()
    for name in ('kvfleet_operator_reconciles_total{result="success"}',
                 'kvfleet_operator_reconcile_errors_total{reason="Conflict"}',
                 "kvfleet_operator_reconcile_duration_seconds_bucket",
                 'kvfleet_operator_child_writes_total{action="create",kind="deployment"}'):
        assert name in text


async def test_kvfleet_operator_run_subprocess(api, emulator, kubeconfig, unused_tcp_port_factory):
    """`kvfleet-operator run` as users start it: liveness, /metrics, reconciles, stops on SIGTERM."""
    import os
    import signal
    import sys

    import aiohttp

    live_port, metrics_port = unused_tcp_port_factory(), unused_tcp_port_factory()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvfleet_operator", "run", "--standalone",
        "--liveness", f"http://127.0.0.1:{live_port}/healthz", "--metrics-port", str(metrics_port),
        env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        async def get(url):
            try:
                async with aiohttp.ClientSession() as s, s.get(url) as r:
                    return await r.text() if r.status == 200 else None
            except aiohttp.ClientError:
                return None
        await wait_for(lambda: get(f"http://127.0.0.1:{live_port}/healthz"), timeout=30)
        obj = {"apiVersion": isvc_api.API_VERSION, "kind": isvc_api.KIND,
               "metadata": {"name": "cli", "namespace": "default"},
               "spec": {"model": {"uri": "bundled://smollm2"}, "resources": {"gpus": 0}}}
        await api.create(isvc_api.API_VERSION, isvc_api.PLURAL, "default", obj)
        await wait_for(lambda: api.get("apps/v1", "deployments", "default", "cli"), timeout=30)

        async def counted():
            text = await get(f"http://127.0.0.1:{metrics_port}/metrics") or ""
            return 'kvfleet_operator_reconciles_total{result="success"}' in text
        await wait_for(counted)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 0, err.decode()[-2000:]


async def test_two_operators_only_the_newest_acts(api, emulator):
    """A rolling update of the operator: old (priority 1) and new (priority 2) run together; one acts."""
    from kvfleet_operator import metrics

    emulator.resources[PEERINGS] = kmock.ResourceInfo(kind="ClusterKopfPeering", singular="clusterkopfpeering",
                                                      namespaced=False, verbs={"list", "watch", "get", "patch",
                                                                               "create"})
    runners = [KopfRunner(["run", "-A", "--peering", "kvfleet", "--priority", str(p), "-m",
                           "kvfleet_operator.handlers"], timeout=30, settings=fast_settings()) for p in (1, 2)]
    for runner in runners:
        await asyncio.to_thread(runner.__enter__)
    try:
        async def both_alive():
            obj = await api.get("kopf.dev/v1", "clusterkopfpeerings", None, "kvfleet")
            prios = sorted(p.get("priority") for p in ((obj or {}).get("status") or {}).values() if p)
            return prios == [1, 2]
        await wait_for(both_alive)
        await asyncio.sleep(0.5)  # let the old operator process the peering event and pause
        done = metrics.RECONCILES.labels(result="success")._value.get()
        obj = {"apiVersion": isvc_api.API_VERSION, "kind": isvc_api.KIND,
               "metadata": {"name": "peer", "namespace": "default"},
               "spec": {"model": {"uri": "bundled://smollm2"}, "resources": {"gpus": 0}}}
        await api.create(isvc_api.API_VERSION, isvc_api.PLURAL, "default", obj)
        await wait_for(lambda: api.get("apps/v1", "deployments", "default", "peer"))
        await asyncio.sleep(1.0)
        creates = [w for w in emulator.writes if w["method"] == "POST" and w["resource"] == "deployments"]
        assert len(creates) == 1
        # one create-time pass plus the pass triggered by the new Deployment's event: not two operators' worth
        assert metrics.RECONCILES.labels(result="success")._value.get() - done <= 3
    finally:
        for runner in reversed(runners):
            await asyncio.to_thread(runner.__exit__, None, None, None)
