"""``orchard bench k8s`` (added to ``orchard bench`` by the plugin's ``orchard_add_commands``).

Against a cluster: ``--settings`` names a YAML file of the backend's settings (kubeconfig,
namespace, injector image, ...). With ``--test-server`` it runs against the Pod-API test
double of this source tree (``tests/pod_api_server.py``: no API server can be installed on
our machines), whose own request counts are added to the report.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import click

from orchard.cli.bench import report
from orchard.cli.common import handle_errors
from orchard.errors import InvalidRequest


def _test_double() -> Any:
    """The test double's module, from the source checkout (it is not part of the package)."""
    tests = Path(__file__).resolve().parents[1] / "tests"
    if not (tests / "pod_api_server.py").exists():
        raise InvalidRequest(f"--test-server needs a source checkout of orchard-k8s (no {tests}/pod_api_server.py)")
    sys.path.insert(0, str(tests))
    import pod_api_server

    return pod_api_server


def against_test_double(sandboxes: int, concurrency: int) -> dict[str, Any]:
    """The bench against the test double, with the double's count of every API request."""
    from orchard.bundle.build import build_bundle
    from orchard.testing.images import build_kit_image
    from orchard_k8s.bench import measure

    double = _test_double()
    scratch = Path(tempfile.mkdtemp(prefix="orchard-bench-k8s-double-"))
    scratch.chmod(0o755)
    try:
        build_bundle(scratch / "bundle")
        server = double.PodApiTestServer(scratch / "bundle", {double.KIT_IMAGE: build_kit_image(scratch / "image")})
        server.start()
        try:
            settings = {"kubeconfig": str(server.kubeconfig(scratch / "kubeconfig")), "namespace": "orchard-bench",
                        "start_timeout": 300}
            calls_before = server.pod_calls()
            result = asyncio.run(measure(settings, double.KIT_IMAGE, sandboxes, concurrency))
            calls = server.pod_calls() - calls_before
        finally:
            server.stop()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result.update(api_server="Pod-API test double (tests/pod_api_server.py)", api_requests_seen=calls,
                  api_requests_per_life_cycle=round(calls / sandboxes, 3),
                  watch_requests_seen=server.watches,
                  list_requests_seen=sum(n for (method, _), n in server.requests.items() if method == "LIST"))
    return result


@click.command("k8s")
@click.option("--settings", "settings_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="YAML file of the k8s backend's settings (kubeconfig, namespace, ...)")
@click.option("--test-server", is_flag=True, help="run against the Pod-API test double of this source tree")
@click.option("--image", default=None, help="sandbox image (with --test-server: the double's kit image)")
@click.option("-n", "--sandboxes", type=int, default=100, show_default=True, help="life cycles to run")
@click.option("-c", "--concurrency", type=int, default=32, show_default=True, help="sandboxes alive at once")
@click.option("--output", type=click.Path(path_type=Path), default=None, help="write the JSON here")
@handle_errors
def bench_k8s(settings_file: Optional[Path], test_server: bool, image: Optional[str], sandboxes: int,
              concurrency: int, output: Optional[Path]) -> None:
    """N sandboxes through `orchard serve --backend k8s`: create-to-ready, API calls per life cycle."""
    import yaml

    from orchard_k8s.bench import measure

    if test_server:
        result = against_test_double(sandboxes, concurrency)
    else:
        if settings_file is None or image is None:
            raise InvalidRequest("give --settings and --image (or --test-server)")
        settings = yaml.safe_load(settings_file.read_text()) or {}
        result = asyncio.run(measure(settings, image, sandboxes, concurrency))
    title = f"orchard bench k8s{' --test-server' if test_server else ''} -n {sandboxes} -c {concurrency}"
    report(result, title, output)
    if result["succeeded"] != sandboxes:
        raise SystemExit(1)
