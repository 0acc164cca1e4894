"""Moving pages between tiers: the mover that walks the ordered tiers (`mover`), the count of moves
(`move_stats`), the disk work of loads and write-behind (`pageio`), evict/flush/rebalance
(`maintenance`) and the one background component that drives them (`daemon`).
"""
