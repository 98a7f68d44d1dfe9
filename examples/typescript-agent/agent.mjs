// A reference agent against `spendgate demo`: the official `openai` package through
// spendgate's proxy for the model rounds, spendgate's TypeScript client (clients/typescript)
// for the run and the paid tool. Plain Node 20 or later, no build step:
//
//   (cd clients/typescript && npm ci)      # builds the client this example links to
//   cd examples/typescript-agent && npm ci
//   SPENDGATE_TOKEN=demo-service-... node agent.mjs
//
// As examples/python-agent does: each model round is a step of one run (the `Spendgate-Run`
// header), each search a paid tool step reserved before it runs; it goes on until the model
// answers or spendgate refuses the next step (the run's bounds, or a budget), then prints the
// guest's spend from `GET /v1/usage`.

import OpenAI from "openai";
import { Client, SpendgateRefusal } from "spendgate";

const BASE = process.env.SPENDGATE_URL ?? "http://127.0.0.1:8080";
const TOKEN = process.env.SPENDGATE_TOKEN; // the service token `spendgate demo` printed
const GUEST_IP = "203.0.113.7"; // the guest's address, as your backend would know it
const MODEL = "demo-mini";
const QUESTION = "What does spendgate do? Search the web, then explain.";
const TOOLS = [{
  type: "function",
  function: {
    name: "web_search",
    description: "Search the web",
    parameters: { type: "object", properties: { q: { type: "string" } }, required: ["q"] },
  },
}];

/** The paid tool (a stand-in: a real one would call a search API). */
function webSearch(query) {
  return `3 results for '${query.slice(0, 40)}': spendgate keeps an LLM service within its budgets.`;
}

if (!TOKEN) throw new Error("set SPENDGATE_TOKEN to the service token `spendgate demo` printed");
const sg = new Client({ baseUrl: BASE, serviceToken: TOKEN });
const { session: guest } = await sg.session({ clientIp: GUEST_IP }); // POST /v1/sessions
console.log(`guest session ${guest}`);
const messages = [{ role: "user", content: QUESTION }];
const run = await sg.run({ session: guest, clientIp: GUEST_IP, conversation: "typescript-agent", inputText: QUESTION });
try {
  console.log(`run ${run.runId}: at most ${run.bounds.max_model_rounds} model rounds`);
  const llm = new OpenAI({
    baseURL: `${BASE}/v1`,
    apiKey: TOKEN,
    defaultHeaders: {
      "Spendgate-Session": guest,
      "Spendgate-Client-Ip": GUEST_IP,
      "Spendgate-Conversation": "typescript-agent",
      "Spendgate-Run": run.runId,
    },
  });
  for (let round = 1; round < 1000; round++) { // spendgate's run bounds stop it long before
    // The demo's mock model calls a tool only when told to (here on the first round, with a
    // 4-word query); a real model decides for itself.
    const mock = round === 1 ? { "x-mock-fault": "tool_call", "x-mock-completion-tokens": "4" } : {};
    let reply, response;
    try {
      ({ data: reply, response } = await llm.chat.completions
        .create({ model: MODEL, messages, tools: TOOLS, max_tokens: 16 }, { headers: mock })
        .withResponse());
    } catch (e) {
      if (!(e instanceof OpenAI.APIError)) throw e;
      console.log(`round ${round}: refused, ${e.code}: ${e.message}`); // nothing was spent on it
      break;
    }
    const choice = reply.choices[0];
    console.log(`round ${round}: ${choice.finish_reason}, charged ${response.headers.get("spendgate-charged-micros")} micros`);
    messages.push(choice.message);
    if (choice.finish_reason === "tool_calls") {
      for (const call of choice.message.tool_calls ?? []) {
        let result;
        try {
          result = await run.withToolStep({ tool: "web_search" }, async (step) => { // reserved before it runs
            const found = webSearch(JSON.parse(call.function.arguments).q ?? "");
            const paid = await step.commitUnits(1);
            console.log(`  web_search: charged ${paid.charged_micros} micros`);
            return found;
          });
        } catch (e) {
          if (!(e instanceof SpendgateRefusal)) throw e;
          console.log(`  web_search: refused ${e.code} (${e.scope})`);
          result = `web_search was refused: ${e.code}`;
        }
        messages.push({ role: "tool", tool_call_id: call.id, content: result });
      }
    } else if (choice.finish_reason === "length") {
      messages.push({ role: "user", content: "Go on." });
    } else {
      console.log("answer:", choice.message.content);
      break;
    }
  }
} finally {
  await run.finish(); // steps still held would be charged in full
}
console.log(`run finished: ${run.finished.steps} steps, charged ${run.finished.charged_micros} micros`);

const usage = await sg.usage({ session: guest }); // GET /v1/usage?session=...
const session = usage.scopes.find((s) => s.kind === "session");
console.log(`spent ${session.used_micros} micros of the guest's ${session.limit_micros} (${session.window})`);
