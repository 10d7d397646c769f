"""LLMRouter's settings (`router.request_router_kwargs` in serve_config.yaml), validated at deploy."""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from batcher.simulated import PRESETS


class LLMRouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cost_model: Optional[str] = Field(
        None,
        description="Step-time preset (batcher.simulated.PRESETS) that turns tokens into seconds until "
        "the replicas have measured their own (the prior of router.cost_model); default: the simulated "
        "replica's own preset, else cpu-smollm2 on CPU and h100-llama3-8b on GPU.",
    )
    learn_step_times: bool = Field(
        True,
        description="Use the step times each replica measures (its reports' `step_fit`), shrunk toward "
        "`cost_model`; off: the preset alone.",
    )
    max_blocks_per_replica: int = Field(
        200_000, ge=1, description="Bound of the prefix index per replica (also capped at the replica's KV blocks)."
    )
    index_stride_tokens: int = Field(
        32,
        ge=1,
        description="The prefix index keeps one block of a chain for each this many tokens (in whole "
        "blocks, at least one): a cached prefix is found to within it, for that fraction of the index's work per "
        "request and of its memory (at 8-token blocks, 4: a quarter). A decision needs the match to within a few "
        "dozen tokens; the engine still caches and matches every block. The routers of one deployment must agree "
        "(they do: one config); the routers' exchange and the replicas' eviction reports carry the same blocks.",
    )
    follow_evictions: bool = Field(
        True,
        description="Drop from the prefix index the blocks replicas report they evicted (their reports' "
        "`evicted`); off: the index forgets only by its own LRU, capped at each replica's KV blocks.",
    )
    max_stats_age_s: float = Field(
        5.0,
        gt=0,
        description="Replica reports older than this count as unknown (assumed as loaded as the "
        "fleet's average), never as idle.",
    )
    load_bound: float = Field(
        1.25,
        ge=1.0,
        description="No replica takes a request that would put it above this times the "
        "fleet's mean sequences per replica (bounded-load affinity), unless every replica is above it; beyond it "
        "only within its free batch (sequences that barely slow its step) while its share of this router's recent "
        "requests is within the same factor (router.load_bound).",
    )
    load_window_s: float = Field(
        30.0,
        ge=0.0,
        description="The load bound's fleet mean is the most sequences the fleet held within "
        "this window, so a lull (users reading between turns, the end of a wave) does not push "
        "conversations off the replicas that cache them; the shares of requests are counted over it too (0: the "
        "count at the decision, and no free batch).",
    )
    affinity_margin: float = Field(
        1.2,
        ge=1.0,
        description="How much more expected wait than the best replica a replica holding the "
        "request's longest cached prefix may have and still win, as a factor (1.0: the expected wait alone "
        "decides; 1.2: the holder wins up to 1.2x the best replica's wait). Waits are estimates from reports "
        "up to a period old: without a margin, near-ties swap conversations between replicas, each swap a "
        "recomputed conversation.",
    )
    adapter_load_s: float = Field(
        0.5,
        ge=0.0,
        description="Seconds a replica takes to load a LoRA adapter it does not hold (read, check, "
        "copy into a slot): a request naming an adapter goes to a replica that lacks it only when that "
        "replica's expected seconds plus this beat every holder's (a hot adapter spreads). Among replicas "
        "that lack it, one holding many adapters costs up to half of this more (an eviction).",
    )
    share_index_s: float = Field(
        0.25,
        ge=0.0,
        description="Sharing with the deployment's other routers (each ingress replica and Python "
        "handle caller routes with its own), through one actor, off the decision's path: this router pushes "
        "each request it sends (its replica, its prompt's blocks, its load) and each answer's blocks as soon "
        "as its loop is free, and takes the others' on a subscription the actor sends to at once when one "
        "pushes, or after this many seconds with nothing; a router alone pushes nothing (0: off).",
    )
    default_output_tokens: int = Field(
        128, ge=1, description="Expected answer length until answers have been seen (capped by max_tokens)."
    )
    max_tracked_requests: int = Field(
        100_000, ge=1, description="Bound of the per-request bookkeeping (routed, awaiting answers)."
    )
    # The engine's model and shape: build_app fills these from `engine`, so the router hashes blocks
    # exactly as the replicas cache them (the model names the hash chain's root: batcher.block_hash).
    model: str = Field(description="The engine's model (`engine.model`), the root of the block hashes.")
    block_size: int = Field(8, ge=1)
    max_num_batched_tokens: int = Field(512, ge=1)
    max_num_seqs: int = Field(64, ge=1)

    @property
    def index_stride_blocks(self) -> int:
        """The index keeps one block in this many (`index_stride_tokens` in whole blocks); the replicas
        report only those evicted (deployments.app)."""
        return max(1, self.index_stride_tokens // self.block_size)

    @field_validator("cost_model")
    @classmethod
    def _known_preset(cls, name: Optional[str]) -> Optional[str]:
        if name is not None and name not in PRESETS:
            raise ValueError(f"unknown cost_model {name!r}; known: {', '.join(PRESETS)}")
        return name


# LLMRouter's default index stride in blocks (the defaults' index_stride_tokens over block_size): the
# benchmarks' default (load_tests.exchange_micro, load_tests.eviction_micro).
DEFAULT_INDEX_STRIDE_BLOCKS = LLMRouterConfig(model="-").index_stride_blocks
