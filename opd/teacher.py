"""Teachers: frozen models that score the student's tokens (prefill only), each in its own Ray worker.

`score(samples)` returns, for every sample, log π_T(token_t | tokens_<t) at the rollout temperature on the
action tokens (0 elsewhere). A `local` teacher runs a torch forward in chunks (never full-vocabulary logits for
the whole sequence at once); an `sglang` teacher starts its own SGLang server on the worker's GPUs and asks it
for input-token logprobs (`max_new_tokens: 0`, `logprob_start_len: 0`), as slime's teacher servers do. SGLang
returns those at temperature 1 whatever the request's temperature (opd.config.validate_opd refuses an SGLang
teacher under another rollout temperature).
"""

from __future__ import annotations

import asyncio
import os
import time

import torch

from models import load_model, load_tokenizer, policy_logprobs, resolve_model_path, to_dtype
from models.batching import TokenBatch, make_micro_batches, unbatch
from models.loading import supports_packed_sequences


def check_same_tokenizer(student: str, teachers: dict[str, str]) -> None:
    """OPD compares log-probabilities of the same token ids: a teacher with another vocabulary is refused."""
    ref = load_tokenizer(student)
    ref_vocab = ref.get_vocab()
    for name, path in teachers.items():
        tok = load_tokenizer(path)
        vocab = tok.get_vocab()
        if vocab != ref_vocab or tok.eos_token_id != ref.eos_token_id:
            differ = len(set(vocab.items()) ^ set(ref_vocab.items()))
            raise ValueError(f"teacher {name!r} ({path}) has a different tokenizer from the student ({student}): "
                             f"{len(vocab)} vs {len(ref_vocab)} tokens, {differ} entries differ, eos "
                             f"{tok.eos_token_id} vs {ref.eos_token_id}. OPD scores the student's token ids, so "
                             "teacher and student must share one tokenizer.")


class TeacherWorker:
    """`sglang`: the server's settings for an `sglang` teacher, the fields of the run's `engine.sglang`
    (rollout.config.SGLangConfig) that launch one: launch_command, args, env (e.g. the PYTHONPATH of a carried
    SGLang), host, startup_timeout_s, request_timeout_s; `log_dir`: where its log goes."""

    def __init__(self, name: str, path: str, engine: str = "local", temperature: float = 1.0,
                 dtype: str = "float32", micro_batch_tokens: int = 4096, torch_threads: int = 0,
                 sglang: dict | None = None, log_dir: str | None = None):
        torch.set_num_threads(torch_threads or os.cpu_count() or 1)
        self.name = name
        self.temperature = temperature if temperature > 0 else 1.0
        self.micro_batch_tokens = micro_batch_tokens
        self.busy_s = 0.0
        self.scored_tokens = 0
        self.server = None
        path = str(resolve_model_path(path))
        if engine == "sglang":
            from rollout.sglang.server import SGLangServer

            s = dict(sglang or {})
            self.request_timeout_s = float(s.get("request_timeout_s", 900.0))
            launch = s.get("launch_command") or ("python", "-m", "sglang.launch_server")
            self.server = SGLangServer(path, s.get("args") or {}, list(launch), name=f"teacher-{name}",
                                       host=s.get("host", "127.0.0.1"), env=s.get("env") or {}, log_dir=log_dir,
                                       startup_timeout_s=float(s.get("startup_timeout_s", 900.0)),
                                       memory_retries=int(s.get("memory_retries", 3)))
            self.server.start()
        else:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
            self.model = load_model(path, "policy", dtype=dtype, device=self.device).eval()
            self.model.requires_grad_(False)
            self.dtype = to_dtype(dtype)

    def score(self, samples: list[dict]) -> list[torch.Tensor]:
        """The teacher's logprob of every action token of every sample (0 elsewhere), one tensor per sample."""
        started = time.perf_counter()
        out = self._score_sglang(samples) if self.server is not None else self._score_local(samples)
        self.busy_s += time.perf_counter() - started
        self.scored_tokens += int(sum(float(torch.as_tensor(s["loss_mask"]).sum()) for s in samples))
        return out

    @torch.no_grad()
    def _score_local(self, samples: list[dict]) -> list[torch.Tensor]:
        batch = TokenBatch.from_samples(samples, ("loss_mask",))
        batches = make_micro_batches(batch, ("loss_mask",), self.micro_batch_tokens, self.device,
                                     packed=supports_packed_sequences(self.model))
        outs = [policy_logprobs(self.model, mb.tensors["input_ids"], mb.tensors["attention_mask"], self.temperature,
                                only=mb.tensors["loss_mask"], position_ids=mb.position_ids)[0] for mb in batches]
        return batch.split(unbatch(batches, outs, batch))

    def _score_sglang(self, samples: list[dict]) -> list[torch.Tensor]:
        from rollout.sglang.client import SGLangClient

        async def one(client, s):
            body = await client.post("/generate", {
                "input_ids": torch.as_tensor(s["token_ids"]).tolist(), "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 0, "temperature": self.temperature}})
            lps = [lp for lp, *_ in body["meta_info"]["input_token_logprobs"]]  # entry t: log p(x_t | x_<t)
            if len(lps) != len(s["token_ids"]):
                raise RuntimeError(f"teacher {self.name}: {len(lps)} input logprobs for {len(s['token_ids'])} "
                                   f"tokens from {self.server.url}")
            return torch.tensor([float(lp) if (m and lp is not None) else 0.0 for lp, m in zip(lps, s["loss_mask"])])

        async def all_of():
            client = SGLangClient(self.server.url, self.request_timeout_s)
            try:
                return await asyncio.gather(*(one(client, s) for s in samples))
            finally:
                await client.close()

        return asyncio.run(all_of())

    def stats(self, reset: bool = True) -> dict:
        out = {"busy_s": self.busy_s, "tokens": self.scored_tokens}
        if reset:
            self.busy_s, self.scored_tokens = 0.0, 0
        return out

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()
