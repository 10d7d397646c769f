"""router: request routing across LLM replicas.

- `router:LLMRouter` (llm_router.py): the Ray Serve RequestRouter; select it with
  `router.request_router_class: router:LLMRouter` in serve_config.yaml.
- scoring.py: the score (expected seconds) from plain data; cost_model.py: step times learned from
  what the replicas measure (a preset as the prior); index.py: the per-replica prefix index;
  ledger.py: what the router knows of each request, from decision to answer; feedback.py: answers
  reported back by the caller, through its handle; config.py: LLMRouterConfig (its kwargs).
"""

__all__ = ["LLMRouter", "LLMRouterConfig"]


def __getattr__(name):  # Serve's router classes load on first use, not with `import router`
    if name == "LLMRouter":
        from router.llm_router import LLMRouter

        return LLMRouter
    if name == "LLMRouterConfig":
        from router.config import LLMRouterConfig

        return LLMRouterConfig
    raise AttributeError(name)
