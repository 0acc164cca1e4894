"""What the plugin's tests and benchmark share: SGLang's own HiCacheController, run in this process
on the CPU (one rank, a gloo group), driven the way SGLang's radix cache drives it, over a storage
backend (kvstore's, or one of SGLang's such as "file"), and a `kvstore sidecar` child process.

    ctl = Controller("dynamic", kvstore_extra_config(socket), layout="layer_first")
    tokens = list(range(4096))
    ctl.fill(tokens)                    # random KV in host pages, the pages' hashes as SGLang makes them
    ctl.backup(tokens)                  # write_storage -> the backup thread -> ack_backup_queue
    other = Controller(...)             # a second engine
    other.prefetch(tokens)              # prefetch -> prefetch_hit_queue -> prefetch_buffer -> ack_prefetch_queue
    other.pages(tokens) equals ctl.pages(tokens)
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

GEOMETRY = dict(layers=4, heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
MLA_ROW = (64, 64)   # kv_lora_rank, qk_rope_head_dim of an MLA controller: a row of 128, the sidecar's
MLA_GEOMETRY = dict(GEOMETRY, heads=1, head_dim=sum(MLA_ROW) // 2)   # geometry one KV head of half of it
_group = None


def single_rank_group():
    """A one-process gloo group and SGLang's parallel context for one rank (once per process)."""
    global _group
    if _group is not None:
        return _group
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    _group = dist.new_group([0], backend="gloo")
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1,
                                        attn_dcp_rank=0, attn_tp_rank=0, attn_tp_size=1, attn_dp_rank=0)
    return _group


def kvstore_extra_config(socket_path, **extra) -> dict:
    return {"backend_name": "kvstore", "module_path": "kvstore_sglang.storage", "class_name": "KVStoreStorage",
            "interface_v1": 1, "socket": str(socket_path), **extra}


class Controller:
    """SGLang's HiCacheController over a device KV pool and a host pool (on the CPU)."""

    def __init__(self, backend: str, extra_config: dict | None = None, layout: str = "layer_first",
                 model: str = "tiny-sglang", host_tokens: int = 8192, mla: bool = False, metrics: bool = False,
                 **geometry):
        """An MHA pool of GEOMETRY (overridden by `geometry`), or with `mla` an MLA pool of MLA_ROW."""
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        g = {**GEOMETRY, **geometry}
        self.page_size = ps = g["page_size"]
        self.mla = mla
        group = single_rank_group()
        device_tokens = 4 * ps
        layers = dict(start_layer=0, end_layer=g["layers"])
        if mla:
            kv = MLATokenToKVPool(device_tokens, ps, g["dtype"], *MLA_ROW, g["layers"], "cpu", False, **layers)
        else:
            kv = MHATokenToKVPool(device_tokens, ps, g["dtype"], g["heads"], g["head_dim"], g["layers"], "cpu", False,
                                  **layers)
        allocator = PagedTokenToKVPoolAllocator(device_tokens, ps, g["dtype"], "cpu", kv, False)
        host_cls, more = ((MLATokenToKVPoolHost, {"target_layer_num": g["layers"]}) if mla
                          else (MHATokenToKVPoolHost, {}))
        self.host = host_cls(kv.get_device_pool_infos()[0].buffer_info, host_tokens / device_tokens, 0, ps, layout,
                             pin_memory=False, device_capacity_tokens=device_tokens, **layers, **more)
        self.ctl = HiCacheController(allocator, self.host, ps, group, threading.Event(), io_backend="direct",
                                     storage_backend=backend, model_name=model, enable_storage_metrics=metrics,
                                     storage_backend_extra_config=dict(extra_config or {}))
        self.storage = self.ctl.storage_backend
        self.where: dict[tuple, torch.Tensor] = {}   # tokens -> host indices of their pages here
        self._rid = 0

    # pages in the host pool
    def fill(self, tokens: list[int], seed: int = 0) -> torch.Tensor:
        """Random KV for the full pages of `tokens` in newly allocated host pages; their host indices."""
        n = len(tokens) // self.page_size * self.page_size
        idx = self.host.alloc(n)
        assert idx is not None, "host pool full"
        g = torch.Generator().manual_seed(seed)
        for i in range(0, n, self.page_size):
            page = self.host.get_data_page(int(idx[i]), flat=False)
            page.copy_(torch.randn(page.shape, generator=g).to(page.dtype))
        self.where[tuple(tokens)] = idx
        return idx

    def pages(self, tokens: list[int], pages: int | None = None) -> torch.Tensor:
        """[pages, 2, layers, page_size, heads, dim] (MLA: [pages, layers, page_size, 1, row]): the KV of
        `tokens` here, the same order on any layout."""
        idx = self.where[tuple(tokens)]
        n = len(idx) // self.page_size if pages is None else pages
        k = 0 if self.mla else 1   # the page's first dim after K/V
        out = []
        for i in range(n):
            page = self.host.get_data_page(int(idx[i * self.page_size]), flat=False)
            if self.host.layout == "page_first":          # [(2,) page_size, layers, ...]
                page = page.transpose(k, k + 1)
            elif self.host.layout == "page_first_direct":  # [(2,) 1, layers, page_size, ...]
                page = page.select(k, 0)
            out.append(page.clone())
        return torch.stack(out) if out else torch.empty(0)

    def hashes(self, tokens: list[int]) -> list[str]:
        from sglang.srt.mem_cache.utils import get_storage_hash_str
        return get_storage_hash_str(tokens, None, page_size=self.page_size)

    # the storage paths, as SGLang's radix cache drives them
    def backup(self, tokens: list[int], timeout: float = 60) -> int:
        """write_storage of the pages of `tokens`; the tokens the backup thread acknowledged as stored."""
        idx = self.where[tuple(tokens)]
        op_id = self.ctl.write_storage(idx, tokens, hash_value=self.hashes(tokens))
        deadline = time.monotonic() + timeout
        while True:
            op = self.ctl.ack_backup_queue.get(timeout=max(0.01, deadline - time.monotonic()))
            if op.id == op_id:
                return op.completed_tokens

    def prefetch(self, tokens: list[int], timeout: float = 60) -> int:
        """prefetch of `tokens` into new host pages; the tokens that arrived (0: a miss)."""
        self._rid += 1
        rid = f"req-{self._rid}"
        self.ctl.prefetch(rid, tokens)
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(0.01, deadline - time.monotonic())
        op = self.ctl.prefetch_hit_queue.get(timeout=left())
        assert op.request_id == rid
        hit = op.storage_hit_count
        if hit == 0:
            return 0
        idx = self.host.alloc(hit)
        assert idx is not None, "host pool full"
        op.host_indices = idx
        self.ctl.prefetch_buffer.put(op)
        done = 0
        while True:
            ack = self.ctl.ack_prefetch_queue.get(timeout=left())
            if ack.rid != rid:
                continue
            if ack.completed_tokens is not None:
                done = ack.completed_tokens
            if ack.completed_req:
                break
        self.where[tuple(tokens[:done])] = idx[:done]
        if done < hit:
            self.host.free(idx[done:])
        return done

    def threads_alive(self) -> bool:
        c = self.ctl
        return all(t.is_alive() for t in (c.prefetch_thread, c.prefetch_io_aux_thread, c.backup_thread,
                                          c.prefetch_sync_thread))

    def close(self) -> None:
        self.ctl.detach_storage_backend()


class Sidecar:
    """`python -m kvstore sidecar` with the geometry of GEOMETRY, or `geometry` (a model directory written for it)."""

    def __init__(self, data_dir: Path, socket_path: Path, warm_bytes: str = "64MiB", geometry: dict | None = None,
                 **overrides):
        self.data_dir, self.socket = Path(data_dir), Path(socket_path)
        g = geometry or GEOMETRY
        model = write_model_config(self.data_dir.parent / f"model-{g['layers']}x{g['heads']}x{g['head_dim']}", g)
        page_bytes = 2 * g["layers"] * g["page_size"] * g["heads"] * g["head_dim"] * g["dtype"].itemsize
        self.settings = {"model": str(model), "kv_dtype": str(g["dtype"]).replace("torch.", ""),
                         "page_size": g["page_size"], "warm.bytes": warm_bytes, "cold.max_bytes": "2GiB",
                         "hot.pool": 4 * page_bytes, **overrides}   # hot: unused (pages move through warm)
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        args = [sys.executable, "-m", "kvstore", "sidecar", "--data-dir", str(self.data_dir),
                "--socket", str(self.socket), "--admin-port", "0"]
        for key, value in self.settings.items():
            args += ["--set", f"{key}={value}"]
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.data_dir / "sidecar.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        with open(self.log_path, "a") as logf:
            self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=logf, text=True, env=env)
        lines: queue.Queue = queue.Queue()

        def read() -> None:
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)
        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + 120
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise RuntimeError(f"kvstore sidecar not ready in 120 s:\n{self.log()}") from None
            if line is None:
                raise RuntimeError(f"kvstore sidecar exited with {self.proc.wait()}:\n{self.log()}")
            if line.startswith("kvstore sidecar: ready on "):
                return

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def stop(self, timeout: float = 120) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def write_model_config(directory: Path, g: dict) -> Path:
    """A Hugging Face config.json with this KV geometry (all the sidecar reads of a model)."""
    import json
    directory.mkdir(parents=True, exist_ok=True)
    heads = g["heads"] * 2
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": g["layers"], "num_attention_heads": heads,
        "num_key_value_heads": g["heads"], "head_dim": g["head_dim"], "hidden_size": heads * g["head_dim"],
        "intermediate_size": 4 * heads * g["head_dim"], "vocab_size": 1000}))
    return directory
