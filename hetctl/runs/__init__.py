"""What reads run folders, finished or running: status and stop, the HTML report, and ``plan --calibrate``
(the calibrated speeds, and the link costs fitted to measured steps). Above ``elastic/``: nothing there imports it."""
