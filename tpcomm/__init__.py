"""tpcomm: symmetric memory, mailboxes and the o-projection all-reduce."""
