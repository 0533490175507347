// A team's Pulumi program in TypeScript that builds on a gpu-inference-platform stack: it reads
// the platform's outputs through a StackReference, checks them against the contract's JSON Schema,
// and exports what its own resources would be wired with.
import * as path from "node:path";
import * as pulumi from "@pulumi/pulumi";
import { endpoint, kubeconfig, loadValidator, readPlatform, recommendedBaseUrl } from "./contract";

const config = new pulumi.Config();
const platformStack = config.require("platform_stack");
const model = config.require("model");
const cluster = config.get("cluster");
const schemaFile = path.resolve(config.require("contract_schema"));

const platform = new pulumi.StackReference("platform", { name: platformStack });
const outputs = readPlatform(platform, loadValidator(schemaFile), `outputs of stack '${platformStack}'`);

export const contractVersion = outputs.then((o) => o.contract_version);
export const openaiBaseUrl = outputs.then((o) => recommendedBaseUrl(endpoint(o, model, cluster)));
export const servedModelName = outputs.then((o) => o.models[model]?.served_model_name);
export const platformKubeconfig = cluster === undefined ? undefined : kubeconfig(platform, cluster);
