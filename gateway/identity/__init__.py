"""Who is calling: tenants, API keys, JWTs, the Principal, the admin API."""
