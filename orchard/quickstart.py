"""The quickstart job: real work in isolated sandboxes on this machine.

Each sandbox gets a small Python project (a module with a deliberately different
implementation per sandbox, and its unit tests), runs the tests, and reports. It
shows the whole life cycle a trainer uses: create, upload, exec, read back, delete.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from orchard.client.aio import AsyncClient

MODULE_VARIANTS = {
    "iterative": "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "memoized": "from functools import cache\n\n\n@cache\ndef fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "off-by-one": "def fib(n):\n    a, b = 0, 1\n    for _ in range(n + 1):\n        a, b = b, a + b\n    return a\n",
    "closed-form": "def fib(n):\n    phi = (1 + 5 ** 0.5) / 2\n    return round(phi ** n / 5 ** 0.5)\n",
}
TESTS = """import unittest
from fib import fib


class FibTest(unittest.TestCase):
    def test_small(self):
        self.assertEqual([fib(i) for i in range(10)], [0, 1, 1, 2, 3, 5, 8, 13, 21, 34])

    def test_large(self):
        self.assertEqual(fib(60), 1548008755920)


if __name__ == "__main__":
    unittest.main()
"""


@dataclass
class ProjectResult:
    sandbox_id: str
    variant: str
    passed: bool
    summary: str
    seconds: float
    network_blocked: bool


async def run_project(client: AsyncClient, variant: str) -> ProjectResult:
    start = time.perf_counter()
    async with await client.create("host") as sandbox:
        await sandbox.upload("project/fib.py", MODULE_VARIANTS[variant])
        await sandbox.upload("project/test_fib.py", TESTS)
        job = await sandbox.exec("python3 -m unittest -v 2>&1 | tail -n 4", cwd="project", timeout=60)
        probe = await sandbox.exec("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), 2)\"")
        lines = [line for line in job.stdout.strip().splitlines() if line.strip()]
        return ProjectResult(sandbox.id, variant, lines[-1:] == ["OK"], lines[-1] if lines else job.stderr.strip(),
                             time.perf_counter() - start, probe.exit_code != 0)


async def run_quickstart(copies: int = 1) -> list[ProjectResult]:
    variants = [v for v in MODULE_VARIANTS for _ in range(copies)]
    async with AsyncClient() as client:
        return list(await asyncio.gather(*(run_project(client, v) for v in variants)))
