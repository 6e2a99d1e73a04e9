"""The engine's max_tokens is lowered to what the tenant's monthly token budget has left, so a
stream stops the step the budget runs out (against a real Redis)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from gateway.admission.admission import UNASKED_BUDGET_CAP, Admission, AdmissionSettings
from gateway.identity.principal import Limits, Principal

MakePrincipal = Callable[..., Principal]


@pytest.fixture
async def admission(redis_client: Redis) -> AsyncIterator[Admission]:
    adm = Admission(redis_client, AdmissionSettings(), registry=CollectorRegistry())
    yield adm
    await adm.aclose()


async def test_the_cap_is_what_the_budget_has_left_after_the_prompt(
    admission: Admission, make_principal: MakePrincipal
) -> None:
    who = make_principal(monthly_token_budget=1000)
    ticket = await admission.admit(who, "m", prompt_tokens=100, max_tokens=500)
    assert ticket.max_tokens is None and ticket.budget_stop is None  # 500 fits: no cap
    await admission.settle(ticket, 100, 500)  # 400 left
    ticket = await admission.admit(who, "m", prompt_tokens=100, max_tokens=500)
    assert ticket.max_tokens == 300
    assert ticket.budget_stop == "monthly_token_budget of tenant 'acme'"
    assert ticket.headers["x-portico-budget-max-tokens"] == "300"
    await admission.release(ticket)


async def test_n_completions_share_what_is_left(
    admission: Admission, make_principal: MakePrincipal
) -> None:
    who = make_principal(monthly_token_budget=1000)
    ticket = await admission.admit(who, "m", 100, 500, num_outputs=3)
    assert ticket.max_tokens == 300  # (1000 - 100) // 3
    await admission.release(ticket)


async def test_the_tightest_token_budget_of_tenant_and_key_wins(
    admission: Admission, make_principal: MakePrincipal
) -> None:
    who = make_principal(monthly_token_budget=10_000, key_limits=Limits(monthly_token_budget=150))
    ticket = await admission.admit(who, "m", 50, 500)
    assert ticket.max_tokens == 100
    assert ticket.budget_stop is not None and "key 'key1'" in ticket.budget_stop
    await admission.release(ticket)


async def test_a_prompt_past_the_remainder_still_gets_one_token(
    admission: Admission, make_principal: MakePrincipal
) -> None:
    who = make_principal(monthly_token_budget=100)
    ticket = await admission.admit(who, "m", 300, 50)
    assert ticket.max_tokens == 1
    await admission.release(ticket)


async def test_no_budget_or_a_large_remainder_with_nothing_asked_sends_no_cap(
    admission: Admission, make_principal: MakePrincipal
) -> None:
    ticket = await admission.admit(make_principal(tenant="free"), "m", 10, None)
    assert ticket.max_tokens is None
    who = make_principal(tenant="big", monthly_token_budget=10 * UNASKED_BUDGET_CAP)
    ticket = await admission.admit(who, "m", 10, None)
    assert ticket.max_tokens is None and ticket.budget_stop is None
    await admission.release(ticket)
    who = make_principal(tenant="small", monthly_token_budget=UNASKED_BUDGET_CAP // 2)
    ticket = await admission.admit(who, "m", 10, None)
    assert ticket.max_tokens == UNASKED_BUDGET_CAP // 2 - 10
    await admission.release(ticket)


async def test_embeddings_are_never_capped(
    admission: Admission, make_principal: MakePrincipal
) -> None:
    ticket = await admission.admit(make_principal(monthly_token_budget=5), "m", 50, 0)
    assert ticket.max_tokens is None and ticket.budget_stop is None
    await admission.release(ticket)
