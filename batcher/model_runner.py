"""Runs one scheduled step through the model: packs the batch, builds paged-attention metadata,
returns the logits of the sequences that sample this step."""
from __future__ import annotations

from typing import List

import torch

from batcher.cpu_linear import use_weight_major_linears
from batcher.paged_attention import ATTENTION_NAME, KVCache, PagedMetadata, build_group
from batcher.scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        model.set_attn_implementation(ATTENTION_NAME)
        if device.type == "cpu":
            use_weight_major_linears(model)  # MKL's x @ W^T is slow at decode-sized batches
        self.model = model
        self.device = device
        self.block_size = block_size
        cfg = model.config
        self.gqa_groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.kv_cache = KVCache(cfg, num_blocks, block_size, dtype, device)

    @torch.inference_mode()
    def execute(self, scheduled: List[ScheduledSeq]) -> torch.Tensor:
        """Computes K/V for every scheduled token; returns (num_sampling_seqs, vocab) float logits."""
        bs = self.block_size
        input_ids: List[int] = []
        positions: List[int] = []
        slots: List[int] = []
        sample_index: List[int] = []
        groups = {True: ([], [], [], []), False: ([], [], [], [])}  # by "is decode": starts, lens, ctx, tables
        for s in scheduled:
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            q_start = len(input_ids)
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            g = groups[n == 1]
            g[0].append(q_start)
            g[1].append(n)
            g[2].append(end)
            g[3].append(table[: -(-end // bs)])
            if s.samples:
                sample_index.append(q_start + n - 1)
        meta = PagedMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slots, device=self.device),
            groups=[build_group(*g, bs, self.gqa_groups, self.device) for g in groups.values() if g[0]],
        )
        out = self.model(
            input_ids=torch.tensor([input_ids], device=self.device),
            position_ids=torch.tensor([positions], device=self.device),
            use_cache=False,
            logits_to_keep=torch.tensor(sample_index or [0], device=self.device),
            paged_metadata=meta,
        )
        logits = out.logits[0].float()
        return logits if sample_index else logits[:0]
