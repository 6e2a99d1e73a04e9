"""Where a request goes and how it gets there: routing, pools, proxying, engine supervision."""
