-- Appended to every scenario script by bench/wrk.py: prints one machine-readable line with
-- wrk's own counters, so nothing is scraped from its human-oriented text. A scenario script
-- that defines `extra_report(threads)` returns a JSON object (text) built from its threads'
-- globals (thread:get), printed as a BENCH_EXTRA line.
local threads = {}
local scenario_setup = setup

function setup(thread)
   threads[#threads + 1] = thread
   if scenario_setup then scenario_setup(thread) end
end

function done(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      'BENCH_RESULT {"duration_us":%.0f,"requests":%.0f,"bytes":%.0f,' ..
      '"connect_errors":%.0f,"read_errors":%.0f,"write_errors":%.0f,"status_errors":%.0f,' ..
      '"timeouts":%.0f,"p50_us":%.0f,"p90_us":%.0f,"p99_us":%.0f,"mean_us":%.1f}\n',
      summary.duration, summary.requests, summary.bytes,
      e.connect, e.read, e.write, e.status, e.timeout,
      latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean))
   if extra_report then
      io.write("BENCH_EXTRA " .. extra_report(threads) .. "\n")
   end
end
