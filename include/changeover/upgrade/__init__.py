"""The rolling upgrade: routing to the largest version group (`routing`), placement of the moves (`placement`),
each member's drain (`drain`), a job's move (`relocate`, `warm`), the member sequence (`roll`), the member's restart
at its new version (`member_upgrade`), the upgrade's lock and record (`lock`), verification, recovery, drain
windows and members marked for maintenance."""
