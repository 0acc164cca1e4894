"""Which page is where and which goes next: a page's record (`entry`), the page index over them
(`index`), the eviction policy over it (`policy`), and the policy registry (`registry`).
"""
