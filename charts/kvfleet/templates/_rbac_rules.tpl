{{- /*
Rules on cluster-scoped resources (always in the ClusterRole).
- customresourcedefinitions list/watch: kopf discovers InferenceService and notices CRD changes.
- namespaces list/watch (namespaced mode only): kopf follows the watched namespaces' lifecycle.
- clusterkopfpeerings (cluster-wide peering only): kopf's keep-alives and peer observation.
*/ -}}
{{- define "kvfleet.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if not (include "kvfleet.clusterWide" .) }}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- if and .Values.peering.enabled (include "kvfleet.clusterWide" .) }}
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["list", "watch", "patch"]
{{- end }}
{{- end }}

{{- /*
Rules on namespaced resources: in the ClusterRole (cluster-wide) or in a Role per watched namespace.
- inferenceservices: kopf watches them and patches its own annotations/finalizer (never spec).
- inferenceservices/status: conditions, observedGeneration, replicas, url.
- inferenceservices/scale: read by the autoscaler (`kubectl scale` and HPAs write it, not us).
- deployments, services, poddisruptionbudgets: the children, applied and deleted by the operator.
- pods: read-only, to scrape each serving pod's /metrics for autoscaling.
- events: kopf and the operator post events on InferenceServices.
- kopfpeerings (namespaced peering only).
*/ -}}
{{- define "kvfleet.namespacedRules" -}}
- apiGroups: ["serving.kvfleet.dev"]
  resources: ["inferenceservices"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["serving.kvfleet.dev"]
  resources: ["inferenceservices/status"]
  verbs: ["get", "patch"]
- apiGroups: ["serving.kvfleet.dev"]
  resources: ["inferenceservices/scale"]
  verbs: ["get"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if and .Values.peering.enabled (not (include "kvfleet.clusterWide" .)) }}
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["list", "watch", "patch"]
{{- end }}
{{- end }}
