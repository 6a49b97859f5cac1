"""The scheduler's parts alone, without a model: the batch planner, the prefix cache's keep and share
rules, and the policy's admission order, over a fake llama.cpp context that only records its calls.
The real-model behaviour of the whole loop is tests/test_scheduler*.py."""
from __future__ import annotations

from concurrent.futures import Future

from kvbridge.backends.llama_context import BATCH_TOKENS, Sampler
from kvbridge.engine.records import RequestRecord
from kvbridge.scheduler.events import Journal
from kvbridge.scheduler.ledger import BlockLedger, Holding
from kvbridge.scheduler.planner import SHARED_STEP_PREFILL, plan_batch
from kvbridge.scheduler.policy import Policy
from kvbridge.scheduler.prefix_cache import PrefixCache
from kvbridge.scheduler.requests import Queues, Request
from kvbridge.scheduler.sequences import SequencePool

BLOCK = 16


class FakeContext:
    """The calls the parts make on llama.cpp, recorded; sequences hold what seq_cp gave them."""

    def __init__(self, n_seq: int = 6) -> None:
        self.n_seq = n_seq
        self.calls: list[tuple] = []

    def seq_cp(self, src: int, dst: int, n_tokens: int) -> None:
        self.calls.append(("seq_cp", src, dst, n_tokens))

    def seq_rm(self, seq: int, start: int = -1, stop: int = -1) -> None:
        self.calls.append(("seq_rm", seq))


def make_request(request_id: int, prompt: list[int], priority: int = 5, salt: str = "") -> Request:
    record = RequestRecord(mode="lmcache", request_index=request_id, prompt_tokens=len(prompt), priority=priority)
    return Request(request_id, f"request {request_id}", priority, list(prompt), 8, Sampler(0.0, 1.0, None), (), None,
                   Future(), record, salt=salt)


def parts(limit: int = 2, cells: int = 1024):
    ctx = FakeContext()
    pool = SequencePool(ctx, BlockLedger(cells, BLOCK, 0.25, 0.1, 0.05))
    queues, journal = Queues(), Journal()
    cache = PrefixCache(ctx, pool, queues.running, limit, iter(range(100, 200)), journal)
    return ctx, pool, queues, journal, cache


def holding(pool: SequencePool, request: Request, n_tokens: int) -> None:
    """The request holds a sequence with n_tokens of its context computed (as after its prefill)."""
    request.seq = pool.take()
    request.held = Holding(request.holder)
    pool.ledger.grow(request.held, n_tokens, request.holder)
    request.kv_tokens = n_tokens
    request.pending = request.context[n_tokens:]


# -- the planner ----------------------------------------------------------------------------------
def test_decoding_sequences_go_first_and_a_prefill_beside_them_takes_a_shared_step():
    decoding = [make_request(i, [1, 2, 3]) for i in (1, 2)]
    for i, request in enumerate(decoding):
        request.seq, request.kv_tokens, request.pending = i, 3, [7]
    prefilling = make_request(3, list(range(600)))
    prefilling.seq = 2
    batch = plan_batch([prefilling, *decoding])
    assert [request.id for request, _ in batch] == [1, 2, 3]
    assert [len(entries) for _, entries in batch] == [1, 1, SHARED_STEP_PREFILL]
    assert batch[0][1] == [(7, 3, 0, True)]                  # position kv_tokens, logits wanted
    assert not any(wants for *_, wants in batch[2][1])       # the prompt is not done: no logits yet


def test_a_prefill_alone_takes_the_whole_batch_and_asks_logits_for_its_last_token_only():
    alone = make_request(1, list(range(BATCH_TOKENS + 10)))
    alone.seq = 0
    (request, entries), = plan_batch([alone])
    assert len(entries) == BATCH_TOKENS and not entries[-1][3]
    alone.kv_tokens, alone.pending = BATCH_TOKENS, alone.prompt[BATCH_TOKENS:]
    (_, entries), = plan_batch([alone])
    assert [position for _, position, _, _ in entries] == list(range(BATCH_TOKENS, BATCH_TOKENS + 10))
    assert [wants for *_, wants in entries] == [False] * 9 + [True]


# -- the prefix cache -----------------------------------------------------------------------------
def test_a_finished_prompt_stays_resident_but_for_its_last_token_and_only_once():
    ctx, pool, _, _, cache = parts()
    prompt = list(range(40))
    finished = make_request(1, prompt)
    holding(pool, finished, 40 + 3)          # its prompt and three generated tokens
    finished.generated = [900, 901, 902]
    cache.keep(finished)
    (prefix,) = cache.prefixes
    assert prefix.tokens == prompt[:39] and ("seq_cp", finished.seq, prefix.seq, 39) in ctx.calls
    cache.keep(finished)                     # the same prompt again: nothing new
    assert len(cache.prefixes) == 1


def test_a_short_or_blended_prompt_is_not_kept_and_the_coldest_prefix_makes_room():
    _, pool, _, journal, cache = parts(limit=1)
    short, blended = make_request(1, list(range(BLOCK))), make_request(2, list(range(100, 140)))
    blended.blend = True
    for request in (short, blended):
        holding(pool, request, len(request.prompt))
        cache.keep(request)
    assert cache.prefixes == []              # 15 tokens are under a block; blended cells are not exact KV
    first, second = make_request(3, list(range(200, 240))), make_request(4, list(range(300, 340)))
    for request in (first, second):
        holding(pool, request, 40)
        cache.keep(request)
    assert [p.tokens[0] for p in cache.prefixes] == [300] and journal.counters["evictions"] == 1


def test_sharing_takes_the_longest_run_of_the_same_salt_and_never_the_last_token():
    _, pool, queues, _, cache = parts()
    running = make_request(1, list(range(64)))
    holding(pool, running, 64)
    queues.running.append(running)
    assert cache.best_source(list(range(64)), "") == (running, 63)
    assert cache.best_source(list(range(32)) + [999], "") == (running, 32)
    assert cache.best_source(list(range(64)), "tenant:b") == (None, 0)


# -- the policy -----------------------------------------------------------------------------------
class StartingLifecycle:
    """Starts a request with nothing reused (the restorer's part), so the policy's choices show alone."""

    def __init__(self, queues: Queues, pool: SequencePool) -> None:
        self.queues, self.pool, self.started, self.preempted = queues, pool, [], []

    def start(self, request: Request, resumed: bool) -> None:
        request.seq, request.held = self.pool.take(), Holding(request.holder)
        self.queues.running.append(request)
        self.started.append(request.id)

    def preempt(self, request: Request, why: str) -> None:
        self.queues.running.remove(request)
        self.pool.free_holder(request)
        self.queues.swapped.append(request)
        self.preempted.append(request.id)


def test_waiting_requests_are_admitted_by_priority_and_an_urgent_one_preempts_the_least_urgent():
    _, pool, queues, _, cache = parts()
    lifecycle = StartingLifecycle(queues, pool)
    policy = Policy(queues, pool, cache, lifecycle, max_running=2)
    queues.waiting.extend([make_request(1, [1] * 20, priority=1), make_request(2, [2] * 20, priority=7),
                           make_request(3, [3] * 20, priority=4)])
    policy.admit_waiting()
    assert lifecycle.started == [2, 3] and [r.id for r in queues.waiting] == [1]
    queues.waiting.append(make_request(4, [4] * 20, priority=9))
    policy.admit_waiting()
    assert lifecycle.preempted == [3] and lifecycle.started[-1] == 4
