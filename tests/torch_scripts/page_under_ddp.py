"""A documentation page's plain-PyTorch loop on several gloo ranks, as a user runs it under DDP.

The page's first ``python`` block as written, with two statements added through its syntax tree (the
page's text is not edited): after the top-level ``model = ...`` the ``DistributedDataParallel`` wrap that
the Many GPUs page shows, and after the loop's ``....backward()`` an Inf written into one rank's gradient
at one step (after DDP's all-reduce, so only that rank sees it). Each rank runs in its own process
(``torch.multiprocessing.spawn``, gloo on the CPU); what it prints (stdout, and stderr where warnings go)
lands in ``OUT/rank<r>.txt``, its scaler's final state in ``OUT/rank<r>.json``.

Usage: python page_under_ddp.py PAGE WORLD FAULT_RANK FAULT_STEP OUT
"""

from __future__ import annotations

import ast
import json
import math
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_docs_pages import DOCS, blocks


def _statement(source: str) -> ast.stmt:
    return ast.parse(source).body[0]


def instrumented(page: str) -> ast.Module:
    """The page's first python block with the DDP wrap and the fault hook added."""
    code = next(code for lang, code in blocks(page) if lang == "python")
    tree = ast.parse(code)
    body = tree.body
    model_at = next(i for i, node in enumerate(body) if isinstance(node, ast.Assign)
                    and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["model"])
    body.insert(model_at + 1, _statement("model = torch.nn.parallel.DistributedDataParallel(model)"))
    loop = next(node for node in body if isinstance(node, ast.For))
    backward_at = next(i for i, node in enumerate(loop.body) if ".backward()" in ast.unparse(node))
    loop.body.insert(backward_at + 1, _statement(f"__fault__(model, {ast.unparse(loop.target)})"))
    return ast.fix_missing_locations(tree)


def rank_main(rank: int, world: int, port: int, page: str, fault: tuple[int, int], out: str) -> None:
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)

    def fault_hook(model: torch.nn.Module, step: int) -> None:
        if (rank, step) == fault:
            with torch.no_grad():
                next(model.parameters()).grad.view(-1)[0] = math.inf

    namespace = {"__name__": "__page__", "__fault__": fault_hook}
    exec(compile(instrumented(page), str(DOCS / page), "exec"), namespace)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(namespace["scaler"].get_state()._asdict(), f)
    namespace.clear()  # the DDP model before its process group (through DDP's reducer gloo can hang)
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    page, world, fault_rank, fault_step, out = argv
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(rank_main, nprocs=int(world),
                                args=(int(world), port, page, (int(fault_rank), int(fault_step)), out))


if __name__ == "__main__":
    main(sys.argv[1:])
