"""What a page is: its namespace and shape (`spec`, `shapes`), its key (`keys`), and its record on
disk and on the wire (`record`: header, checksum, bytes).
"""
