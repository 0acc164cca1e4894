"""Which page is where and which goes next: the page index (`index`), the eviction policy over
it (`policy`), and the policy registry (`registry`).
"""
