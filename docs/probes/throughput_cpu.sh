#!/bin/bash
# One throughput run through `orchard serve` (100 sandboxes x M commands at 100 callers) on a
# fresh server and agent, with the CPU of each part per command: the server, the agent, the
# sandboxes' processes (the agent's reaped children: holders, their forks, bash), the benchmark
# client, and the whole machine (/proc/stat). Session 26's figures in benchmarks.md come from it.
# usage: docs/probes/throughput_cpu.sh TAG [M=50]   (run from the repository root, as root, venv built)
set -eu
tag=$1; m=${2:-50}
work=/tmp/orchard-throughput-probe
source .venv/bin/activate
rm -rf "$work"; mkdir -p "$work"
cat > "$work/serve.yaml" <<YAML
port: 8766
state: $work/state.db
backend:
  name: local
  settings:
    agent: {prestart_shell: true, state_dir: $work/agent}
YAML
orchard serve --config "$work/serve.yaml" > "$work/serve.log" 2>&1 &
srv=$!
trap 'kill $srv 2>/dev/null; pkill -f "orchard.agent.*$work/agent" || true' EXIT
for _ in $(seq 100); do curl -sf http://127.0.0.1:8766/health >/dev/null && break; sleep 0.2; done
python3 -c "from orchard.client import Client; c=Client(url='http://127.0.0.1:8766'); s=c.create(image='host'); s.exec('true'); s.delete()"
sleep 1  # the agent starts with the first sandbox
agent=$(python3 -c "import json; print(json.load(open('$work/agent/agent/agent.json'))['pid'])")
st() { awk '{print $14 + $15, $16 + $17}' "/proc/$1/stat"; }
machine() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8}' /proc/stat; }
read -r s0 _ < <(st $srv); read -r a0 c0 < <(st $agent); m0=$(machine)
/usr/bin/time -f "%U %S" -o "$work/client.time" orchard bench sandboxes -n 100 -m "$m" -c 100 \
  --url http://127.0.0.1:8766 --latency-samples 0 --output "$work/bench.json" > "$work/bench.log" 2>&1
read -r s1 _ < <(st $srv); read -r a1 c1 < <(st $agent); m1=$(machine)
python3 - <<PY
import json
bench = json.load(open("$work/bench.json"))
user, system = map(float, open("$work/client.time").read().split()[-2:])
per = 10 / (100 * $m)  # clock ticks (10 ms) -> ms per command
problems = {k: bench[k] for k in ("failures", "commands_failed") if bench[k]}
problems.update({k: v for k, v in bench["leftovers"].items() if v})
if bench["succeeded"] != 100:
    problems["succeeded"] = bench["succeeded"]
print("$tag commands/s %s | ms of CPU per command: server %.2f, agent %.2f, sandbox processes %.2f, client %.2f, "
      "whole machine %.2f | cpu probe %s" % (bench["commands_per_second"], ($s1 - $s0) * per, ($a1 - $a0) * per,
      ($c1 - $c0) * per, (user + system) * 1000 / (100 * $m), ($m1 - $m0) * per, bench.get("cpu_probe_s")))
if problems:  # a run with failed commands or leftovers is not a figure
    raise SystemExit(f"$tag NOT VALID: {problems}")
print("$tag: 100/100 sandboxes, every command exit 0, nothing left behind")
PY
