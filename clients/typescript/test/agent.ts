// An agent that holds a step and never resolves it, for the killed-agent test:
// `node build/test/agent.js URL SERVICE_TOKEN` opens a session, a run and a model step, prints
// {"session", "run_id", "step_id", "reserved_micros"} as one line, then works until killed
// (its heartbeat renews the lease meanwhile).

import { Client } from "../src/index.js";

const [url, token] = process.argv.slice(2);
if (!url || !token) throw new Error("usage: agent.js URL SERVICE_TOKEN");
const sg = new Client({ baseUrl: url, serviceToken: token });
const guest = await sg.session({ clientIp: "203.0.113.9" });
await using run = await sg.run({ session: guest.session, clientIp: "203.0.113.9", conversation: "agent", inputText: "hi" });
await using step = await run.modelStep({ model: "gpt-4o-mini", promptTokens: 1000, maxOutputTokens: 100 });
const line = { session: guest.session, run_id: run.runId, step_id: step.stepId, reserved_micros: step.reservedMicros };
process.stdout.write(JSON.stringify(line) + "\n");
// the paid work, which never ends
await new Promise((resolve) => setTimeout(resolve, 1e9));
