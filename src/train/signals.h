// Signal policy of a training run (DESIGN.md invariant 2; the SIGHUP report in shared/context):
// - SIGHUP never stops a run: it is recorded and logged, output goes on to the log file.
// - SIGPIPE is ignored (a closed `| tee` must not kill a run).
// - SIGXFSZ is ignored: a file past `ulimit -f` fails its write with EFBIG (a named Io error)
//   instead of killing the run silently.
// - SIGTERM / SIGINT request a stop: the loop finishes or abandons the step, checkpoints and
//   exits 0. A second SIGINT exits at once (status 130); checkpoints are atomic, so the last
//   complete one stays intact.
// Handlers only set flags (async-signal-safe); the loop polls them.
#pragma once

namespace opd {

enum class StopRequest { None, Terminate, Interrupt };

void install_training_signal_handlers();
StopRequest stop_requested();
int hangups_received();       // SIGHUPs since install (the loop logs new ones)
void clear_stop_request();    // tests

}  // namespace opd
