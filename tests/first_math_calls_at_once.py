"""Two threads make a fresh process's first calls into torch's CPU math at the same moment: are they exact?

Run as a script (``python tests/first_math_calls_at_once.py CHILDREN``): this process imports torch, and minidp
unless ``--without-minidp``, computes nothing, and forks CHILDREN children, each then a process in which nothing
has been computed yet. In each, two threads meet at a barrier and call every function of ``--functions`` (default
``tanh``) on float and on double tensors of numbers in [-2, 2); every result must agree bit for bit with the same call made afterwards.
Prints the seeds of the children in which one did not, and of those that raised or crashed.
tests/test_cpu_threads.py runs it; docs: minidp/cpu_threads.py (finish_vector_math_setup).
"""

import argparse
import os
import threading
import traceback

parser = argparse.ArgumentParser()
parser.add_argument("children", type=int)
parser.add_argument("--functions", default="tanh", help="comma-separated torch functions, e.g. tanh,exp,sin")
parser.add_argument("--without-minidp", action="store_true", help="import torch alone")
options = parser.parse_args()

import torch  # noqa: E402

if not options.without_minidp:
    import minidp  # noqa: E402,F401  (its import makes the first vector-math call)

FUNCTIONS = options.functions.split(",")


def child(seed: int, threads: int = 2) -> bool:
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.rand(16, generator=generator, dtype=dtype) * 4 - 2 for dtype in (torch.float32, torch.float64)]
    together = threading.Barrier(threads)
    results: dict = {}

    def calls(thread: int) -> None:
        together.wait()  # every thread makes its calls at the same moment
        for name in FUNCTIONS:
            for i, row in enumerate(rows):
                results[thread, name, i] = getattr(torch, name)(row)

    others = [threading.Thread(target=calls, args=(t,)) for t in range(1, threads)]
    for thread in others:
        thread.start()
    calls(0)
    for thread in others:
        thread.join()
    # Bit for bit; a NaN (log of a negative number) where the later call has one too.
    return all(torch.allclose(result, getattr(torch, name)(rows[i]), rtol=0, atol=0, equal_nan=True)
               for (_, name, i), result in results.items())


wrong, failed = [], []  # seeds; (seed, exit code) of a child that raised or crashed
for seed in range(options.children):
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if child(seed) else 1)
        except BaseException:
            traceback.print_exc()
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 1:
        wrong.append(seed)
    elif code != 0:
        failed.append((seed, code))
print("children with a call that was not exact:", wrong, "failed:", failed)
