"""The rolling upgrade: placement of the moves (`placement`), each member's drain (`drain`), a job's move
(`relocate`, `warm`), the member sequence (`roll`), the member's restart at its new version (`member_upgrade`), the
upgrade's lock and record (`lock`), verification, recovery, drain windows, members marked for maintenance, and a
job's code update (`code_update`)."""
