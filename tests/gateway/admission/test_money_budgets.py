"""Money: the spend formula in integer micro-dollars, prices from config and Redis, and daily or
monthly budgets per tenant and key, checked and charged by the admission script on a real Redis
(one server, and a Redis Cluster: every key of a tenant shares its hash tag)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from redis.asyncio import RedisCluster

from gateway.admission.admission import (
    Admission,
    AdmissionSettings,
    BudgetExceededError,
    LimitExceededError,
    utc_day,
    utc_month,
)
from gateway.identity.plans import LimitsSpec
from gateway.identity.prices import ModelPrice, PriceBook, usd_to_micro
from gateway.identity.principal import Limits, Principal
from gateway.store import RedisClient, RedisTopology, StoreSettings, connect

MakePrincipal = Callable[..., Principal]


@pytest.fixture(params=["redis-server", "redis-cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[RedisClient]:
    name = "redis_url" if request.param == "redis-server" else "redis_cluster_url"
    url = request.getfixturevalue(name)
    client = connect(RedisTopology.parse(url), StoreSettings())
    yield client
    await client.aclose()


@pytest.fixture
async def admission(store: RedisClient) -> AsyncIterator[Admission]:
    adm = Admission(store, AdmissionSettings(), registry=CollectorRegistry())
    yield adm
    await adm.aclose()


async def snapshot(redis: RedisClient) -> dict[bytes, object]:
    """Every key and its content (buckets, slots, budgets)."""
    if isinstance(redis, RedisCluster):
        keys = await redis.keys("*", target_nodes=RedisCluster.ALL_NODES)
    else:
        keys = await redis.keys("*")
    state: dict[bytes, object] = {}
    for key in sorted(keys):
        kind = await redis.type(key)
        if kind == b"hash":
            state[key] = await redis.hgetall(key)
        elif kind == b"zset":
            state[key] = await redis.zrange(key, 0, -1)
        else:
            state[key] = await redis.get(key)
    return state


# ------------------------------------------------------------------------ the formula


def test_spend_is_the_price_formula_in_integer_micro_dollars() -> None:
    price = ModelPrice(input=0.15, cached_input=0.075, output=0.6)
    assert price.units == (150_000, 75_000, 600_000)
    # 800 uncached x 0.15 + 200 cached x 0.075 + 100 x 0.6, in micro-dollars
    assert price.spend_micro_usd(1000, 200, 100) == 120 + 15 + 60
    # one million tokens of each kind: exactly the prices
    assert ModelPrice(input=2.5, output=10).spend_micro_usd(10**6, 0, 10**6) == 12_500_000
    # rounded half up, once per request: 3 tokens x 0.5 micro-dollars = 1.5 -> 2
    assert ModelPrice(input=0.5, output=0).spend_micro_usd(3, 0, 0) == 2
    assert ModelPrice(input=0.4, output=0).spend_micro_usd(3, 0, 0) == 1
    # cached input defaults to the input price; cached tokens never exceed the prompt
    assert ModelPrice(input=1, output=0).spend_micro_usd(10, 10, 0) == 10
    assert ModelPrice(input=1, cached_input=0, output=0).spend_micro_usd(10, 99, 0) == 0
    # a sum of many requests has no float drift: 10,000 x 0.1 micro-dollar-rounding cases
    total = sum(ModelPrice(input=0.1, output=0.3).spend_micro_usd(10, 0, 10) for _ in range(10**4))
    assert total == 4 * 10**4


def test_an_image_price_is_per_image_on_top_of_the_tokens() -> None:
    from gateway.admission.spend import MoneyLeft, money_cap, money_needs

    price = ModelPrice(input=1, output=2, image=0.25)  # $0.25 a picture
    assert price.image_units == 250_000
    assert price.public()["image"] == 0.25
    assert "image" not in ModelPrice(input=1, output=2).public()
    # 600 prompt tokens (images' included) x 1 + 10 x 2 + 2 images x 250,000 micro-dollars
    assert price.spend_micro_usd(600, 0, 10, 2) == 600 + 20 + 500_000
    assert price.spend_micro_usd(600, 0, 10) == 620  # no image: tokens only
    assert ModelPrice(input=1, output=2).spend_micro_usd(600, 0, 10, 2) == 620  # no image price
    # admission: what a request surely costs includes its images; the cap leaves room for them
    assert money_needs((True, False), price, 600, 1, 2) == (600 + 2 + 500_000, 0)
    left = MoneyLeft("daily_budget", "tenant", "daily", 10**6, 10**6 - 500_000 - 600 - 100)
    capped = money_cap([left], price, 600, 1, 2)
    assert capped is not None and capped[0] == 50  # 100 micro-dollars at 2 a token


def test_prices_and_budgets_are_validated() -> None:
    for bad in (-1.0, float("inf"), float("nan"), "1", None, 2e6):
        with pytest.raises(ValidationError):
            ModelPrice.model_validate({"input": bad, "output": 1})
    with pytest.raises(ValidationError):
        ModelPrice.model_validate({"input": 1})  # output is required
    with pytest.raises(ValidationError):
        ModelPrice.model_validate({"input": 1, "output": 1, "currency": "eur"})
    assert usd_to_micro(0.3) == 300_000 and usd_to_micro(19.99) == 19_990_000
    with pytest.raises(ValidationError):
        LimitsSpec.model_validate({"budget_usd": -5})
    with pytest.raises(ValidationError):
        LimitsSpec.model_validate({"budget_usd": 5, "budget_period": "weekly"})
    spec = LimitsSpec.model_validate({"budget_usd": 5, "budget_period": "daily"})
    assert spec.to_limits() == Limits(budget_usd=5.0, budget_period="daily")


async def test_admin_prices_override_the_config_on_every_replica(store: RedisClient) -> None:
    configured = {"m": ModelPrice(input=1, output=2), "n": ModelPrice(input=3, output=4)}
    mine, other = PriceBook(store, configured), PriceBook(store, configured)
    assert mine.spend_micro_usd("m", 1000, 0, 1000) == 3000
    assert mine.spend_micro_usd("unpriced", 10**6, 0, 10**6) == 0
    entry = await mine.put("m", ModelPrice(input=10, cached_input=1, output=20))
    assert entry.source == "admin"
    assert mine.spend_micro_usd("m", 1000, 500, 1000) == 5000 + 500 + 20_000
    assert other.spend_micro_usd("m", 1000, 0, 1000) == 3000  # until it refreshes
    await other.refresh()
    assert other.spend_micro_usd("m", 1000, 500, 1000) == 25_500
    assert [(e.model, e.source) for e in other.entries()] == [("m", "admin"), ("n", "config")]
    assert await mine.delete("m") and not await mine.delete("m")
    await other.refresh()
    assert other.entry("m") is not None and other.entry("m").source == "config"  # type: ignore[union-attr]


# ------------------------------------------------------------------------ budgets


async def test_spent_daily_budget_refuses_before_the_request_and_charges_nothing(
    admission: Admission, store: RedisClient, make_principal: MakePrincipal
) -> None:
    who = make_principal(
        requests_per_minute=100, tokens_per_minute=100_000, budget_usd=0.01, budget_period="daily"
    )
    spend_key = f"portico:spend:{{acme}}:t:d:{utc_day(time.time())}"
    ticket = await admission.admit(who, "m", 100, 100)
    await admission.settle(ticket, 100, 50, spend_micro_usd=6_000)
    assert await store.get(spend_key) == b"6000"
    assert await store.ttl(spend_key) > 60 * 86400 - 10
    ticket = await admission.admit(who, "m", 100, 100)  # 0.006 < 0.01: still admitted
    await admission.settle(ticket, 100, 50, spend_micro_usd=4_000)
    before = await snapshot(store)
    with pytest.raises(BudgetExceededError) as info:
        await admission.admit(who, "m", 100, 100)
    assert await snapshot(store) == before  # no bucket, slot or budget moved
    err = info.value
    assert isinstance(err, LimitExceededError)  # the gateway counts it like other limits
    assert err.status_code == 429 and err.code == "budget_exceeded"
    assert (err.limit, err.scope) == ("daily_budget_usd", "tenant")
    assert err.to_dict()["error"]["type"] == "insufficient_quota"
    assert "daily_budget_usd of tenant 'acme'" in err.message
    assert "$0.010000 of $0.01 spent today" in err.message
    assert err.headers["x-should-retry"] == "false"


async def test_key_budget_refuses_that_key_only_and_monthly_is_the_default(
    admission: Admission, store: RedisClient, make_principal: MakePrincipal
) -> None:
    key1 = make_principal(key_id="k1", key_limits=Limits(budget_usd=1))
    key2 = make_principal(key_id="k2", key_limits=Limits(budget_usd=1))
    ticket = await admission.admit(key1, "m", 10, 10)
    await admission.settle(ticket, 10, 10, spend_micro_usd=1_000_000)
    month = utc_month(time.time())
    assert await store.get(f"portico:spend:{{acme}}:k:k1:m:{month}") == b"1000000"
    with pytest.raises(BudgetExceededError) as info:
        await admission.admit(key1, "m", 10, 10)
    assert (info.value.limit, info.value.scope) == ("monthly_budget_usd", "key")
    assert "key 'k1' of tenant 'acme'" in info.value.message
    assert "this month" in info.value.message
    await admission.release(await admission.admit(key2, "m", 10, 10))


async def test_tokens_and_money_are_charged_in_one_settle(
    admission: Admission, store: RedisClient, make_principal: MakePrincipal
) -> None:
    who = make_principal(monthly_token_budget=10**6, budget_usd=100)
    ticket = await admission.admit(who, "m", 300, 100)
    await admission.settle(ticket, 300, 40, spend_micro_usd=1234)
    month = utc_month(time.time())
    assert await store.get(f"portico:budget:{{acme}}:t:{month}") == b"340"
    assert await store.get(f"portico:spend:{{acme}}:t:m:{month}") == b"1234"
    # released without a settle (usage unknown): no money is charged
    await admission.release(await admission.admit(who, "m", 1, 1))
    assert await store.get(f"portico:spend:{{acme}}:t:m:{month}") == b"1234"


async def test_a_zero_budget_admits_nothing(
    admission: Admission, make_principal: MakePrincipal
) -> None:
    with pytest.raises(BudgetExceededError):
        await admission.admit(make_principal(budget_usd=0), "m", 1, 1)


async def test_budget_outranks_a_spent_rate_limit(
    admission: Admission, make_principal: MakePrincipal
) -> None:
    """The client is told the reason it should act on first: no retry helps a spent budget."""
    who = make_principal(requests_per_minute=1, budget_usd=0.000001)
    ticket = await admission.admit(who, "m", 1, 1)
    await admission.settle(ticket, 1, 1, spend_micro_usd=1)
    with pytest.raises(BudgetExceededError):
        await admission.admit(who, "m", 1, 1)


async def test_tenant_budgets_are_gauges_as_of_the_last_admission(
    store: RedisClient, make_principal: MakePrincipal
) -> None:
    registry = CollectorRegistry()
    adm = Admission(store, AdmissionSettings(), registry=registry)
    who = make_principal(budget_usd=2.5, key_limits=Limits(budget_usd=1, budget_period="daily"))
    await adm.settle(await adm.admit(who, "m", 1, 1), 1, 1, spend_micro_usd=750_000)
    await adm.release(await adm.admit(who, "m", 1, 1))
    labels = {"tenant": "acme", "period": "monthly"}
    assert registry.get_sample_value("portico_spend_budget_usd", labels) == 2.5
    assert registry.get_sample_value("portico_spend_budget_spent_usd", labels) == 0.75
    # key budgets are not gauges (label values bounded by tenants, not keys)
    daily = {"tenant": "acme", "period": "daily"}
    assert registry.get_sample_value("portico_spend_budget_usd", daily) is None
    await adm.aclose()


async def test_a_completion_is_capped_at_what_the_money_left_pays_for(
    store: RedisClient, make_principal: MakePrincipal
) -> None:
    """The engine then stops by itself the step the budget runs out (finish_reason length)."""
    prices = PriceBook(store, {"m": ModelPrice(input=1000, output=2000)})  # 1000 / 2000 µ$
    adm = Admission(store, AdmissionSettings(), registry=CollectorRegistry(), prices=prices)
    who = make_principal(budget_usd=0.01)  # 10,000 micro-dollars
    # 3 prompt tokens cost 3,000: 7,000 left pay for 3 completion tokens of 2,000
    ticket = await adm.admit(who, "m", 3, 100)
    assert ticket.max_tokens == 3 and ticket.budget_stop == "monthly_budget_usd of tenant 'acme'"
    assert ticket.headers["x-portico-budget-max-tokens"] == "3"
    await adm.release(ticket)
    ticket = await adm.admit(who, "m", 3, 2)  # asks for less than is left: untouched
    assert ticket.max_tokens is None and ticket.budget_stop is None
    await adm.release(ticket)
    # two completions share what is left; a key's tighter budget wins
    tight = make_principal(budget_usd=0.01, key_limits=Limits(budget_usd=0.005))
    ticket = await adm.admit(tight, "m", 1, 100, num_outputs=2)
    assert ticket.max_tokens == 1 and ticket.budget_stop == (
        "monthly_budget_usd of key 'key1' of tenant 'acme'"
    )
    await adm.release(ticket)
    assert (await adm.admit(who, "unpriced", 3, 100)).max_tokens is None
    await adm.aclose()


async def test_a_budget_that_cannot_pay_for_the_prompt_refuses_and_is_never_overrun(
    store: RedisClient, make_principal: MakePrincipal
) -> None:
    """What a request surely costs (its prompt and one output token per completion) must fit
    in what is left: else 429 budget_exceeded, charged nothing, and the budget ends exactly
    spent, never past it."""
    prices = PriceBook(store, {"m": ModelPrice(input=1000, output=2000)})  # 1000 / 2000 µ$
    adm = Admission(store, AdmissionSettings(), registry=CollectorRegistry(), prices=prices)
    who = make_principal(requests_per_minute=100, budget_usd=0.01)  # 10,000 micro-dollars
    ticket = await adm.admit(who, "m", 4, 1)
    await adm.settle(ticket, 4, 1, spend_micro_usd=6_000)  # 4,000 left
    before = await snapshot(store)
    with pytest.raises(BudgetExceededError) as info:
        await adm.admit(who, "m", 3, 100)  # 3,000 + 2,000 for one token: more than 4,000
    assert await snapshot(store) == before  # no bucket, slot or budget moved
    err = info.value
    assert (err.status_code, err.code, err.limit) == (429, "budget_exceeded", "monthly_budget_usd")
    assert "costs at least $0.005000" in err.message and "only $0.004000 left" in err.message
    ticket = await adm.admit(who, "m", 2, 100)  # 2,000 + 2,000: exactly what is left
    assert ticket.max_tokens == 1
    assert ticket.headers["x-portico-budget-max-tokens"] == "1"
    assert ticket.headers["x-portico-budget-stop"] == "monthly_budget_usd of tenant 'acme'"
    await adm.settle(ticket, 2, 1, spend_micro_usd=prices.spend_micro_usd("m", 2, 0, 1))
    month = utc_month(time.time())
    assert await store.get(f"portico:spend:{{acme}}:t:m:{month}") == b"10000"  # not past it
    await adm.aclose()


def test_a_stream_cut_by_a_money_budget_ends_with_budget_exceeded() -> None:
    from gateway.relay.budget_stop import BudgetStop

    stop = BudgetStop("daily_budget_usd of key 'k1' of tenant 'acme'", 3)
    stop.feed(b'data: {"choices":[{"finish_reason":"length"}]}\n\n')
    end = stop.feed(b"data: [DONE]\n\n")
    event = json.loads(end.split(b"\n\n")[0].removeprefix(b"data: "))
    assert event["error"]["code"] == "budget_exceeded"
    assert event["error"]["type"] == "insufficient_quota"
    assert "daily_budget_usd of key 'k1'" in event["error"]["message"]
    assert "00:00 UTC" in event["error"]["message"]


async def test_an_outage_does_not_hand_a_spent_money_budget_back(
    private_redis, redis_client_factory, make_principal: MakePrincipal
) -> None:  # type: ignore[no-untyped-def]
    """While Redis is down (policy local, 2 replicas), this replica may spend its half of what
    Redis last said was left, and no more."""
    client = redis_client_factory(private_redis.url)
    settings = AdmissionSettings(replicas=2, redis_timeout_seconds=0.5)
    adm = Admission(client, settings, registry=CollectorRegistry())
    who = make_principal(budget_usd=1)
    await adm.settle(await adm.admit(who, "m", 1, 1), 1, 1, spend_micro_usd=800_000)
    await adm.release(await adm.admit(who, "m", 1, 1))  # Redis reports 0.8 spent
    private_redis.stop()
    # 0.2 left in all: this replica's share is 0.1
    await adm.settle(await adm.admit(who, "m", 1, 1), 1, 1, spend_micro_usd=99_999)
    await adm.settle(await adm.admit(who, "m", 1, 1), 1, 1, spend_micro_usd=1)
    with pytest.raises(BudgetExceededError):
        await adm.admit(who, "m", 1, 1)
    await adm.aclose()
    await client.aclose()


async def test_a_model_budget_refuses_that_model_only(
    admission: Admission, store: RedisClient, make_principal: MakePrincipal
) -> None:
    """A per-model budget (plan or tenant model_limits): the gateway falls back to the next
    tier when one is configured (scope "model"), as for the model's other limits."""
    who = make_principal(model_limits={"big": Limits(budget_usd=0.5, budget_period="daily")})
    await admission.settle(await admission.admit(who, "big", 1, 1), 1, 1, spend_micro_usd=500_000)
    day = utc_day(time.time())
    assert await store.get(f"portico:spend:{{acme}}:m:big:d:{day}") == b"500000"
    with pytest.raises(BudgetExceededError) as info:
        await admission.admit(who, "big", 1, 1)
    assert (info.value.limit, info.value.scope) == ("daily_budget_usd", "model")
    assert "model 'big' for tenant 'acme'" in info.value.message
    await admission.release(await admission.admit(who, "small", 1, 1))
