"""Whether a request may run now: rate limits, quotas, abuse guards, usage recording."""
