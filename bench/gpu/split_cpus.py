"""Print two CPU lists for `python -m bench.engine --server-cpus A --client-cpus B`.

The CPUs this process may run on, grouped by the physical core they share (SMT siblings stay
together): the last quarter of the cores (at least one) for the benchmark's client, the rest
for the servers. Usage on the GPU machine:

    read SERVER CLIENT < <(python3 bench/gpu/split_cpus.py)
"""

import os


def cpu_list(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def main() -> None:
    allowed = os.sched_getaffinity(0)
    cores = []
    for cpu in sorted(allowed):
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            siblings = cpu_list(f.read()) & allowed
        if min(siblings) == cpu:
            cores.append(sorted(siblings))
    if len(cores) < 2:
        raise SystemExit("split_cpus: fewer than two physical cores to split")
    client_cores = max(1, len(cores) // 4)
    joined = lambda group: ",".join(str(cpu) for core in group for cpu in core)  # noqa: E731
    print(joined(cores[:-client_cores]), joined(cores[-client_cores:]))


if __name__ == "__main__":
    main()
